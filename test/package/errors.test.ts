/**
 * RdmaError follows Node's convention for system errors: `errno` is the
 * number (negative, as util.getSystemErrorName expects), `errnoName` the name,
 * `syscall` the failed call.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { getSystemErrorName } from "node:util";
import { constants } from "node:os";
import { RdmaBuilder, RdmaError } from "../../src/index.js";

describe("RdmaError errno convention", () => {
  it("a refused connection carries errno -ECONNREFUSED, errnoName and syscall", async () => {
    // a port that was just listening and is closed now: nothing accepts there
    const srv = createServer();
    await new Promise<void>((res) => srv.listen(0, "127.0.0.1", res));
    const port = (srv.address() as { port: number }).port;
    await new Promise<void>((res) => srv.close(() => res()));
    const e = await new RdmaBuilder().setProvider("tcp").connect(`127.0.0.1:${port}`).then(
      () => assert.fail("connected to a closed port"),
      (err: unknown) => err,
    );
    assert.ok(e instanceof RdmaError);
    assert.equal(e.code, "CONNECTION_REFUSED");
    assert.equal(e.errnoName, "ECONNREFUSED");
    assert.equal(typeof e.errno, "number");
    assert.equal(e.errno, -constants.errno.ECONNREFUSED);
    assert.equal(getSystemErrorName(e.errno!), "ECONNREFUSED");
    assert.equal(e.syscall, "connect");
  });

  it("issue 19 point 19: a port in use is ADDRESS_IN_USE with errno -EADDRINUSE, errnoName and syscall", async () => {
    const srv = createServer();
    await new Promise<void>((res) => srv.listen(0, "127.0.0.1", res));
    const port = (srv.address() as { port: number }).port;
    try {
      const e = await new RdmaBuilder()
        .setProvider("tcp")
        .bind(`127.0.0.1:${port}`)
        .then(
          async (l) => {
            await l.close();
            assert.fail("bound a port in use");
          },
          (err: unknown) => err,
        );
      assert.ok(e instanceof RdmaError);
      assert.equal(e.code, "ADDRESS_IN_USE");
      assert.equal(e.errnoName, "EADDRINUSE");
      assert.equal(e.errno, -constants.errno.EADDRINUSE);
      assert.equal(getSystemErrorName(e.errno!), "EADDRINUSE");
      assert.equal(e.syscall, "listen");
    } finally {
      await new Promise<void>((res) => srv.close(() => res()));
    }
  });

  it("errno is undefined without a name, or when the name is not an errno", () => {
    assert.equal(new RdmaError("TIMEOUT", "t").errno, undefined);
    assert.equal(new RdmaError("TIMEOUT", "t").errnoName, undefined);
    const d = new RdmaError("INVALID_STATE", "released", { errnoName: "DESTROYED" });
    assert.equal(d.errnoName, "DESTROYED");
    assert.equal(d.errno, undefined);
    assert.equal(new RdmaError("INVALID_ARGUMENT", "x", { errnoName: "EINVAL" }).errno, -constants.errno.EINVAL);
  });
});
