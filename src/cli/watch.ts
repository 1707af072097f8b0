/**
 * kvxfer watch <addr> [--from N] [--transfer ID]... [--kind K]... [--count N] [--json]:
 * one line per event, live; reconnects and resumes after its last seq.
 */
import type { SidecarClient } from "../api/client.js";
import { parseArgs } from "node:util";
import { EVENT_KINDS } from "../sidecar/event-log.js";
import type { EventKind } from "../sidecar/view.js";
import {
  type CliIo,
  TLS_OPTIONS,
  UsageError,
  clientFrom,
  describeError,
  explainClientError,
  formatEvent,
  output,
  stopSignal,
  toJson,
} from "./grpc-client.js";

/** Reconnect attempts in a row before `watch` gives up (--retries). */
export const WATCH_RETRIES = 10;

export async function runWatch(argv: string[], io: CliIo = {}): Promise<number> {
  const { out, err } = output(io);
  let values;
  let address: string | undefined;
  let from: number | undefined;
  let count = Infinity;
  let retries = WATCH_RETRIES;
  let client: SidecarClient;
  try {
    const parsed = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        from: { type: "string" },
        transfer: { type: "string", multiple: true },
        kind: { type: "string", multiple: true },
        count: { type: "string" },
        retries: { type: "string" },
        json: { type: "boolean", default: false },
        ...TLS_OPTIONS,
      },
    });
    values = parsed.values;
    if (parsed.positionals.length > 1)
      throw new UsageError(`unexpected arguments: ${parsed.positionals.slice(1).join(" ")}`);
    address = parsed.positionals[0];
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
    client = clientFrom(address, values);
  } catch (e) {
    err(`kvxfer watch: ${describeError(e)} (kvxfer watch --help for usage)`);
    return 2;
  }
  const tls = values.ca !== undefined || values.cert !== undefined;
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
          `kvxfer watch: ${e === undefined ? "the stream closed" : explainClientError(e, address!, tls)}; reconnecting (${n}/${retries})`,
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
    err(
      `kvxfer watch: ${explainClientError(e, address!, tls, values.verbose)}${gaveUp} (last seq ${watch.lastSeq})`,
    );
    return 1;
  } finally {
    stop.signal.removeEventListener("abort", onStop);
    stop.dispose();
    client.close();
  }
}
