/**
 * A KV client: a few PUTs, one-sided GETs (a READ of the owner's table,
 * no message), a GET by message, a miss and a DELETE.
 * Run: node dist/examples/kv/client.js host:port name
 */
import assert from "node:assert/strict";
import { RdmaBuilder } from "../../src/index.js";
import { KvClient } from "./kv.js";

const [addr = "127.0.0.1:5555", name = "alice"] = process.argv.slice(2);
const rdma = await new RdmaBuilder().connect(addr);
console.log(`connected (provider ${rdma.provider})`);
const kv = await KvClient.open(rdma);
const text = (v: Uint8Array | null): string | null => (v === null ? null : new TextDecoder().decode(v));

for (let i = 0; i < 3; i++) await kv.put(`${name}:${i}`, new TextEncoder().encode(`hello ${i} from ${name}`));
for (let i = 0; i < 3; i++) {
  const v = text(await kv.get(`${name}:${i}`)); // one READ of the owner's memory
  console.log(`get ${name}:${i} -> ${v}`);
  assert.equal(v, `hello ${i} from ${name}`);
}
assert.equal(text(await kv.getRpc(`${name}:1`)), `hello 1 from ${name}`); // the same GET by message
assert.equal(await kv.get(`${name}:nope`), null);
console.log(`get ${name}:nope -> miss`);
assert.equal(await kv.delete(`${name}:0`), true);
assert.equal(await kv.get(`${name}:0`), null);
console.log(`deleted ${name}:0; ${kv.retries} reads caught a slot mid-write and were retried`);
kv.close();
await rdma.close();
