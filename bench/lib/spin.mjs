// Keeps this process's event loop turning (one Immediate per turn) until the
// returned function is called: the loop then never sleeps in epoll between
// socket events, as the library's busy and adaptive polling keep it turning
// after activity. The benchmarks' plain-Node references use it under
// --node-spin, so a latency ratio can be read against a Node program that
// spins too, not only against one that sleeps.
export function keepTurning() {
  let on = true;
  const turn = () => {
    if (on) setImmediate(turn);
  };
  turn();
  return () => {
    on = false;
  };
}

/** keepTurning() when the environment asks for it (NODE_REF_SPIN=1), else a no-op stop. */
export function spinIfAsked() {
  return process.env.NODE_REF_SPIN === "1" ? keepTurning() : () => {};
}
