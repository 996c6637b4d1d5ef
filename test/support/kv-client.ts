/**
 * A KV client process for test/api/kv (examples/kv, on the provider and
 * connection manager under test). argv: addr role id n
 *   put: PUTs values of KEYS (kv-values.ts) in turn, printing "putting" after
 *        the first, until "stop" arrives on stdin; then prints {"puts": …}.
 *   get: one-sided GETs of KEYS and ABSENT until it made at least n GETs and
 *        saw values change at least n/20 times; checks every value; prints
 *        {"gets", "misses", "absentGets", "changes", "retries", "bad": [...]}.
 */
import { builder } from "./api.js";
import { lineFrom } from "./procs.js";
import { ABSENT, KEYS, checkValue, makeValue, versionOf } from "./kv-values.js";
import { KvClient } from "../../examples/kv/kv.js";

const [addr, role, id, n] = [process.argv[2]!, process.argv[3]!, Number(process.argv[4]), Number(process.argv[5])];
const rdma = await builder("client").connect(addr);
const kv = await KvClient.open(rdma);

if (role === "put") {
  let stop = false;
  void lineFrom(process.stdin, /^stop$/m).then(() => (stop = true));
  let puts = 0;
  for (let seq = 1; !stop; seq++) {
    const k = (seq * 3 + id) % KEYS.length;
    await kv.put(KEYS[k]!, makeValue(k, id, seq, kv.geometry.valueMax));
    if (++puts === 1) console.log("putting");
  }
  process.stdin.pause();
  console.log(JSON.stringify({ puts }));
} else {
  const last = new Map<string, string>();
  const bad: string[] = [];
  let gets = 0;
  let misses = 0;
  let absentGets = 0;
  let changes = 0;
  for (let i = 0; gets < n || changes < n / 20; i++) {
    gets++;
    if (i % 8 === 7) {
      absentGets++;
      const key = ABSENT[i % ABSENT.length]!;
      const v = await kv.get(key);
      if (v === null) misses++;
      else bad.push(`${key}: a value for a key never put`);
      continue;
    }
    const k = (i * 5 + id) % KEYS.length;
    const v = await kv.get(KEYS[k]!);
    if (v === null) {
      misses++;
      bad.push(`${KEYS[k]}: miss for a key always present`);
      continue;
    }
    const why = checkValue(v, k);
    if (why !== null) bad.push(`${KEYS[k]}: ${why}`);
    else {
      const ver = versionOf(v);
      if (last.has(KEYS[k]!) && last.get(KEYS[k]!) !== ver) changes++;
      last.set(KEYS[k]!, ver);
    }
    if (bad.length > 20) break;
  }
  console.log(JSON.stringify({ gets, misses, absentGets, changes, retries: kv.retries, bad }));
}
kv.close();
await rdma.close();
