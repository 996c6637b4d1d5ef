// The reference RPC on a plain Node socket, shared by the benchmarks that
// compare async-rdma/rpc against it (rpc-vs-node.mjs, rpc-cpu.mjs,
// layers.mjs): length-prefixed frames with request ids, 8-byte header
// (u32 id, u32 length, big-endian) then the payload. The server echoes each
// whole frame as soon as it is parsed; the client matches replies to calls
// by id through a Map, as a minimal RPC client on `net.Socket` would.
import net from "node:net";

/** Makes `s` (a connected net.Socket) an echo server: every frame it reads is written back. */
export function serveNodeEcho(s) {
  let buf = Buffer.alloc(0);
  s.on("data", (d) => {
    buf = buf.length ? Buffer.concat([buf, d]) : d;
    let off = 0;
    while (buf.length - off >= 8) {
      const len = buf.readUInt32BE(off + 4);
      if (buf.length - off < 8 + len) break;
      s.write(buf.subarray(off, off + 8 + len)); // echo the frame (id + payload)
      off += 8 + len;
    }
    buf = buf.subarray(off);
  });
  s.on("error", () => {});
}

/** An RPC client on `s` (a connected net.Socket): `call(bytes)` resolves with the echoed payload. */
export function nodeRpcClient(s) {
  const pending = new Map();
  let id = 0;
  let buf = Buffer.alloc(0);
  s.on("data", (d) => {
    buf = buf.length ? Buffer.concat([buf, d]) : d;
    let off = 0;
    while (buf.length - off >= 8) {
      const len = buf.readUInt32BE(off + 4);
      if (buf.length - off < 8 + len) break;
      const i = buf.readUInt32BE(off);
      const r = pending.get(i);
      pending.delete(i);
      r?.(buf.subarray(off + 8, off + 8 + len));
      off += 8 + len;
    }
    buf = buf.subarray(off);
  });
  return (b) =>
    new Promise((r) => {
      const h = Buffer.alloc(8);
      h.writeUInt32BE(++id, 0);
      h.writeUInt32BE(b.length, 4);
      pending.set(id, r);
      s.write(Buffer.concat([h, b]));
    });
}

/** Server and client of the echo RPC in this process, on loopback: `call(bytes)`, and `close()`. */
export async function nodeRpcPair() {
  const srv = net.createServer({ noDelay: true }, serveNodeEcho);
  await new Promise((r) => srv.listen(0, "127.0.0.1", r));
  const s = net.connect({ port: srv.address().port, host: "127.0.0.1", noDelay: true });
  await new Promise((r) => s.once("connect", r));
  return {
    call: nodeRpcClient(s),
    close: () => {
      s.destroy();
      srv.close();
    },
  };
}
