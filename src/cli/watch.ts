/**
 * kvxfer watch <addr> [--from N] [--transfer ID]... [--kind K]... [--count N] [--json]:
 * one line per event, live; reconnects and resumes after its last seq.
 */
import { EVENT_KINDS } from "../sidecar/event-log.js";
import type { EventKind } from "../sidecar/view.js";
import {
  type CliIo,
  UsageError,
  explainClientError,
  formatEvent,
  openClientCommand,
  output,
  stopSignal,
  toJson,
} from "./grpc-client.js";

/** Reconnect attempts in a row before `watch` gives up (--retries). */
export const WATCH_RETRIES = 10;

export async function runWatch(argv: string[], io: CliIo = {}): Promise<number> {
  const { out, err } = output(io);
  const cmd = openClientCommand("watch", argv, err, {
    options: {
      from: { type: "string" },
      transfer: { type: "string", multiple: true },
      kind: { type: "string", multiple: true },
      count: { type: "string" },
      retries: { type: "string" },
      json: { type: "boolean", default: false },
    },
    positionals: 1,
    check: (values) => {
      let from: number | undefined;
      let count = Infinity;
      let retries = WATCH_RETRIES;
      if (values.from !== undefined) {
        from = Number(values.from);
        if (!Number.isSafeInteger(from) || from < 0)
          throw new UsageError(`--from must be a sequence number >= 0, got '${values.from}'`);
      }
      if (values.count !== undefined) {
        count = Number(values.count);
        if (!Number.isSafeInteger(count) || count < 1)
          throw new UsageError(`--count must be a positive integer, got '${values.count}'`);
      }
      if (values.retries !== undefined) {
        retries = Number(values.retries);
        if (!Number.isSafeInteger(retries) || retries < 0)
          throw new UsageError(`--retries must be an integer >= 0, got '${values.retries}'`);
      }
      for (const k of values.kind ?? [])
        if (!EVENT_KINDS.includes(k as EventKind))
          throw new UsageError(`unknown kind '${k}' (known: ${EVENT_KINDS.join(", ")})`);
      return { from, count, retries };
    },
  });
  if (cmd === undefined) return 2;
  const { client, values, address, tls } = cmd;
  const { from, count, retries } = cmd.args;
  const stop = stopSignal(io);
  let seen = 0;
  const watch = client.watchResumable(
    {
      ...(from === undefined ? { liveOnly: true } : { afterSeq: Math.max(0, from - 1) }),
      ...(values.transfer !== undefined ? { transferIds: values.transfer } : {}),
      ...(values.kind !== undefined ? { kinds: values.kind } : {}),
      maxRetries: retries,
      onReconnect: (n, e) =>
        err(
          `kvxfer watch: ${e === undefined ? "the stream closed" : explainClientError(e, address, tls)}; reconnecting (${n}/${retries})`,
        ),
    },
    (ev) => {
      out(values.json ? toJson(ev) : formatEvent(ev));
      if (++seen >= count) watch.cancel();
    },
  );
  const onStop = () => watch.cancel();
  stop.signal.addEventListener("abort", onStop, { once: true });
  if (stop.signal.aborted) watch.cancel();
  try {
    await watch.done;
    return 0;
  } catch (e) {
    const gaveUp = watch.reconnects >= retries ? `; gave up after ${retries} retries` : "";
    err(`kvxfer watch: ${cmd.explain(e)}${gaveUp} (last seq ${watch.lastSeq})`);
    return 1;
  } finally {
    stop.signal.removeEventListener("abort", onStop);
    stop.dispose();
    client.close();
  }
}
