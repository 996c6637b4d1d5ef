#!/usr/bin/env node
// The reference for the tcp provider: plain Node TCP, written for the purpose.
//
//   node bench/lib/node-tcp.mjs server [--host 0.0.0.0] [--port 0]
//       prints {"type":"listening","port":N}, serves one client, exits
//   node bench/lib/node-tcp.mjs client HOST PORT bw SIZE COUNT [WARM]
//       a socket writing COUNT Buffers of SIZE bytes in a loop, with
//       backpressure (write() false → wait for 'drain'); the server answers one
//       byte when all bytes arrived. Bandwidth = bytes / (first write → that byte).
//   node bench/lib/node-tcp.mjs client HOST PORT pp SIZE COUNT [WARM]
//       ping-pong: SIZE bytes out, the server echoes them; latency = RTT / 2.
// Both sides set TCP_NODELAY. Prints one JSON result line (MB = 2^20 bytes).
// With NODE_REF_SPIN=1 in the environment both sides keep their event loop
// turning (bench/lib/spin.mjs): the reference for a library that spins.
import net from "node:net";
import { spinIfAsked } from "./spin.mjs";

const stopSpin = spinIfAsked();

const [role, ...rest] = process.argv.slice(2);

function usage() {
  console.error("usage: node-tcp.mjs server [--host H] [--port P] | client HOST PORT bw|pp SIZE COUNT [WARM]");
  process.exit(2);
}

if (role === "server") {
  let host = "0.0.0.0";
  let port = 0;
  for (let i = 0; i < rest.length; i++) {
    if (rest[i] === "--host") host = rest[++i];
    else if (rest[i] === "--port") port = Number(rest[++i]);
    else usage();
  }
  const server = net.createServer({ noDelay: true }, (sock) => {
    server.close();
    let hdr = "";
    let cfg = null;
    let got = 0;
    let phaseEnd = 0;
    let phase = 0;
    let pending = 0;
    sock.on("data", (chunk) => {
      if (cfg === null) {
        const s = chunk.toString("latin1");
        const i = s.indexOf("\n");
        if (i < 0) {
          hdr += s;
          return;
        }
        cfg = JSON.parse(hdr + s.slice(0, i));
        chunk = chunk.subarray(i + 1);
        phaseEnd = cfg.warm * cfg.size;
      }
      if (cfg.mode === "bw") {
        got += chunk.length;
        while (phase < 2 && got >= phaseEnd) {
          sock.write(phase === 0 ? "w" : "d");
          phase++;
          phaseEnd += cfg.count * cfg.size;
        }
      } else {
        // echo each complete message
        pending += chunk.length;
        while (pending >= cfg.size) {
          pending -= cfg.size;
          sock.write(echo ?? (echo = Buffer.alloc(cfg.size)));
        }
      }
    });
    let echo = null;
    sock.on("error", () => {});
    sock.on("close", () => process.exit(0));
  });
  server.listen(port, host, () => console.log(JSON.stringify({ type: "listening", port: server.address().port })));
} else if (role === "client") {
  const [host, portS, mode, sizeS, countS, warmS] = rest;
  const size = Number(sizeS);
  const count = Number(countS);
  if (!host || !(mode === "bw" || mode === "pp") || !(size > 0) || !(count > 0)) usage();
  const warm = warmS !== undefined ? Number(warmS) : Math.min(count, mode === "bw" ? Math.max(16, Math.floor(2 ** 28 / size / 4)) : 1000);
  const sock = net.connect({ host, port: Number(portS), noDelay: true });
  await new Promise((r, j) => {
    sock.once("connect", r);
    sock.once("error", j);
  });
  sock.write(JSON.stringify({ mode, size, count, warm }) + "\n");
  const buf = Buffer.alloc(size, 0x61);
  if (mode === "bw") {
    const acks = [];
    let waiter = null;
    sock.on("data", (d) => {
      for (const c of d.toString("latin1")) acks.push(c);
      if (waiter) waiter();
    });
    const ack = () =>
      new Promise((r) => {
        const check = () => {
          if (acks.length) {
            waiter = null;
            r(acks.shift());
          } else waiter = check;
        };
        check();
      });
    const writeN = (n) =>
      new Promise((resolve) => {
        let i = 0;
        const go = () => {
          while (i < n) {
            i++;
            if (!sock.write(buf)) {
              sock.once("drain", go);
              return;
            }
          }
          resolve();
        };
        go();
      });
    await writeN(warm);
    await ack();
    const t0 = performance.now();
    await writeN(count);
    await ack();
    const sec = (performance.now() - t0) / 1000;
    console.log(JSON.stringify({ type: "result", mode, size, count, seconds: sec, bwAvg: (size * count) / sec / 1048576, msgRate: count / sec / 1e6 }));
  } else {
    let got = 0;
    let wake = null;
    sock.on("data", (d) => {
      got += d.length;
      if (got >= size && wake) {
        got -= size;
        const w = wake;
        wake = null;
        w();
      }
    });
    const once = () =>
      new Promise((r) => {
        if (got >= size) {
          got -= size;
          r();
        } else wake = r;
        sock.write(buf);
      });
    for (let i = 0; i < warm; i++) await once();
    const s = new Float64Array(count);
    for (let i = 0; i < count; i++) {
      const t = performance.now();
      await once();
      s[i] = ((performance.now() - t) * 1000) / 2;
    }
    s.sort();
    let sum = 0;
    for (const x of s) sum += x;
    const pct = (p) => s[Math.min(count - 1, Math.ceil(p * count) - 1)];
    console.log(JSON.stringify({ type: "result", mode, size, count, tMin: s[0], tTypical: s[count >> 1], tAvg: sum / count, p99: pct(0.99), p999: pct(0.999), tMax: s[count - 1] }));
  }
  stopSpin();
  sock.end();
} else usage();
