/**
 * async-rdma/rpc in one program: a server with two methods and a client that
 * calls them, many at once, with a typed error and a cancelled call.
 * Run: npm run build && node dist/examples/rpc/run.js
 */
import { RdmaBuilder } from "../../src/index.js";
import { RpcClient, RpcError, RpcServer } from "../../src/rpc/index.js";

const text = new TextEncoder();
const str = new TextDecoder();

const listener = await new RdmaBuilder().bind("127.0.0.1:0");
const server = new RpcServer({
  // bytes in, bytes out
  upper: (payload) => text.encode(str.decode(payload).toUpperCase()),
  // errors travel back with their code
  divide: (payload) => {
    const [a, b] = new Float64Array(payload.slice().buffer);
    if (b === 0) throw Object.assign(new Error("division by zero"), { code: "EDOM" });
    return new Uint8Array(new Float64Array([a! / b!]).buffer);
  },
  // a slow method that stops when the caller gives up
  slow: (_payload, { signal }) =>
    new Promise<void>((resolve) => {
      const t = setTimeout(resolve, 60_000);
      signal.addEventListener("abort", () => {
        clearTimeout(t);
        console.log("server: slow call cancelled by the client");
        resolve();
      });
    }),
});
void server.listen(listener);

const client = new RpcClient(await new RdmaBuilder().connect(`127.0.0.1:${listener.port}`));

console.log(str.decode(await client.call("upper", text.encode("hello, rdma"))));

// 100 calls in flight at once
const words = Array.from({ length: 100 }, (_, i) => `word${i}`);
const upper = await Promise.all(words.map((w) => client.call("upper", text.encode(w))));
console.log(`100 concurrent calls: ${str.decode(upper[99])}`);

try {
  await client.call("divide", new Uint8Array(new Float64Array([1, 0]).buffer));
} catch (e) {
  if (e instanceof RpcError) console.log(`typed error: ${e.code} (${e.message})`);
}

try {
  await client.call("slow", new Uint8Array(0), { timeoutMs: 200 });
} catch (e) {
  console.log(`client: ${(e as Error).message}`);
}

await client.close();
await listener.close();
console.log("rpc example done");
