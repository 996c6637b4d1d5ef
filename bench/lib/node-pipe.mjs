// The plain Node reference for bench/cp-vs-rsync: a file piped into a TCP
// socket and from the socket into a file, nothing else (no checksum, no
// fsync, no temporary name).
//   node bench/lib/node-pipe.mjs server DIR          prints "port N"; one file per connection
//   node bench/lib/node-pipe.mjs client HOST PORT FILE
import net from "node:net";
import { createReadStream, createWriteStream } from "node:fs";
import { join } from "node:path";

const [mode, ...a] = process.argv.slice(2);
if (mode === "server") {
  let n = 0;
  const srv = net.createServer((sock) => {
    const out = createWriteStream(join(a[0], `received-${n++}`));
    sock.pipe(out);
    // the answer once every byte is in the file (written, not flushed: like rsync)
    out.on("finish", () => sock.end("k"));
  });
  srv.listen(0, "0.0.0.0", () => console.log(`port ${srv.address().port}`));
} else if (mode === "client") {
  const sock = net.connect({ host: a[0], port: Number(a[1]) });
  sock.on("connect", () => createReadStream(a[2], { highWaterMark: 1 << 20 }).pipe(sock));
  sock.on("data", () => sock.destroy());
} else {
  console.error("usage: node-pipe.mjs server DIR | client HOST PORT FILE");
  process.exit(2);
}
