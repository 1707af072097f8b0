// Setup file of vitest.mutation.config.ts. StrykerJS runs vitest in a worker thread (it forces
// pool "threads"), where setting the umask throws ERR_WORKER_UNSUPPORTED_OPERATION; the engine
// link sets it around its ipc bind (src/engine/link-server.ts, start()). Here setting it is a no-op that
// returns the current mask; the link's chmod to 0600 after the bind still runs, and no test in the
// mutation run checks the socket's mode (test/engine/link-owner.test.ts does, in `npm test`).
import { isMainThread } from "node:worker_threads";

if (!isMainThread) {
  const umask = process.umask.bind(process);
  process.umask = () => umask();
}
