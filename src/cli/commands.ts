/**
 * The product's `kvxfer` subcommands, declared once: their flags and their
 * kinds, what each is for, how it runs. `contract.ts` turns these into the
 * parser, each command's `--help` and the main usage. The simulator's and the
 * benchmarks' commands (demo, sim-engine, native-demo, bench) are declared in
 * their own packages, loaded by optional.ts.
 */
import { EVENT_KINDS } from "../sidecar/event-log.js";
import { runSidecar } from "./sidecar.js";
import { SIDECAR_SETTINGS, type SettingName } from "./sidecar-settings.js";
import { runAwait } from "./await.js";
import {
  BOOL_STR,
  choice,
  type CommandSpec,
  FLAG,
  JSON_OPT,
  type Kind,
  LOG_LEVELS,
  NON_NEG_INT,
  type OptSpec,
  POS_INT,
  STR,
} from "./contract.js";
import { runStatus } from "./status.js";
import { runWatch } from "./watch.js";

/**
 * The kind of each sidecar setting's value (all arrive as strings: flag, env or
 * config file). A setting not listed takes any string; the sidecar checks it.
 */
const SIDECAR_KINDS: Partial<Record<SettingName, Kind>> = {
  "engine-id": STR,
  role: choice("prefill", "decode", "both"),
  "engine-socket": STR,
  "engine-max-frame-bytes": POS_INT,
  listen: STR,
  "peer-cert": STR,
  "peer-key": STR,
  "peer-ca": STR,
  "insecure-peers": BOOL_STR,
  mode: choice("push", "pull", "auto"),
  transports: STR,
  "net-devices": STR,
  "error-mode": choice("none", "peer"),
  "busy-poll": BOOL_STR,
  "spin-us": STR, // "auto" or a non-negative integer: the sidecar checks it
  "lease-ms": POS_INT,
  "reg-lease-ms": POS_INT,
  "transfer-timeout-ms": POS_INT,
  "heartbeat-ms": POS_INT,
  "peer-timeout-ms": POS_INT,
  "peer-keepalive-ms": NON_NEG_INT,
  "abort-grace-ms": POS_INT,
  "settle-bound-ms": POS_INT,
  "max-transfers": POS_INT,
  "kv-dir": STR,
  "max-registration-bytes": { t: "bytes" },
  "max-kv-bytes": { t: "bytes" },
  prefault: BOOL_STR,
  "exclusive-prefill-blocks": BOOL_STR,
  "tombstone-ms": POS_INT,
  "event-log-capacity": POS_INT,
  grpc: STR,
  metrics: STR,
  "otlp-endpoint": STR,
  advertise: STR,
  bootstrap: STR,
  "notify-zmq": STR,
  "tls-cert": STR,
  "tls-key": STR,
  "tls-ca": STR,
  "drain-ms": POS_INT,
  "engine-lease-ms": NON_NEG_INT,
  "log-level": choice(...LOG_LEVELS),
  config: STR,
};

const SIDECAR_OPTIONS: OptSpec[] = (
  Object.entries(SIDECAR_SETTINGS) as [SettingName, { help: string; default: string }][]
).map(([name, s]) => ({
  name,
  kind: SIDECAR_KINDS[name] ?? STR,
  ...((SIDECAR_KINDS[name] ?? STR).t === "string"
    ? { arg: name === "engine-id" ? "ID" : "VALUE" }
    : {}),
  help: s.help,
  def: s.default,
  ...(name === "engine-id" ? { required: true } : {}),
}));

/** The client commands' TLS flags and --verbose. */
const CLIENT_OPTIONS: OptSpec[] = [
  {
    name: "ca",
    kind: STR,
    arg: "FILE",
    help: "trust this CA for the sidecar's certificate; turns TLS on",
  },
  { name: "cert", kind: STR, arg: "FILE", help: "client certificate, for mutual TLS (with --key)" },
  { name: "key", kind: STR, arg: "FILE", help: "client key, for mutual TLS (with --cert)" },
  {
    name: "server-name",
    kind: STR,
    arg: "NAME",
    help: "check the sidecar's certificate against this name instead of the address host",
  },
  { name: "verbose", kind: FLAG, help: "errors with their details and stack" },
];

const ADDRESS = { name: "host:port", required: true };
const ADDRESS_EPILOG =
  'host:port is the sidecar\'s gRPC address, as its ready line prints it ("grpc"): ' +
  "--grpc defaults to 127.0.0.1:0 (a free port), so there is no fixed default port.";

export const COMMANDS: readonly CommandSpec[] = [
  {
    path: ["sidecar"],
    summary:
      "one sidecar next to one engine; every flag may also come from KVXFER_<FLAG> (e.g. KVXFER_ENGINE_ID) or a JSON --config file",
    options: SIDECAR_OPTIONS,
    epilog:
      "settings: flag > KVXFER_<FLAG> environment variable > --config file > default.\n" +
      'stdout: one {"event":"ready",...} line once listening (its "grpc" is the address for status/watch/await).',
    valueStyle: "eq",
    run: (argv) => runSidecar(argv),
  },
  {
    path: ["status"],
    args: [ADDRESS],
    summary: "the sidecar's identity, peers, transfers by state, bytes moved, event log, health",
    options: [
      JSON_OPT,
      {
        name: "timeout",
        kind: { t: "number", min: 0, above: true },
        arg: "MS",
        help: "per call",
        def: "10000",
      },
      {
        name: "trace",
        kind: STR,
        arg: "TRANSFER_ID",
        help: "instead: that transfer's hops on this sidecar (µs, this host's monotonic clock)",
      },
      ...CLIENT_OPTIONS,
    ],
    epilog: ADDRESS_EPILOG,
    valueStyle: "eq",
    run: (argv) => runStatus(argv),
  },
  {
    path: ["watch"],
    args: [ADDRESS],
    summary:
      "events as they happen, one per line; reconnects and resumes after the last seq it printed",
    options: [
      {
        name: "from",
        kind: NON_NEG_INT,
        arg: "SEQ",
        help: "start with event SEQ (0: every retained event); default: new events only",
      },
      { name: "transfer", kind: STR, arg: "ID", help: "only this transfer", multiple: true },
      {
        name: "kind",
        kind: choice(...EVENT_KINDS),
        help: "only this kind of event",
        multiple: true,
      },
      { name: "count", kind: POS_INT, help: "exit after N events" },
      {
        name: "retries",
        kind: NON_NEG_INT,
        help: "reconnect attempts in a row before giving up (exit 1)",
        def: "10",
      },
      JSON_OPT,
      ...CLIENT_OPTIONS,
    ],
    epilog: ADDRESS_EPILOG,
    valueStyle: "eq",
    run: (argv) => runWatch(argv),
  },
  {
    path: ["await"],
    args: [ADDRESS, { name: "transfer-id", required: true }],
    summary:
      "waits for one transfer's terminal event (exit 0 KV_READY or RELEASED, 1 FAILED, EXPIRED or ABORTED, 3 timed out, 4 other error)",
    options: [
      {
        name: "timeout",
        kind: { t: "number", min: 0, above: true },
        arg: "MS",
        help: "how long to wait",
        def: "30000",
      },
      { name: "side", kind: choice("prefill", "decode"), help: "which side's end to wait for" },
      JSON_OPT,
      ...CLIENT_OPTIONS,
    ],
    epilog:
      ADDRESS_EPILOG +
      "\nexit 0: KV_READY or RELEASED; 1: FAILED, EXPIRED or ABORTED; 2: usage; 3: timed out; 4: other error",
    valueStyle: "eq",
    run: (argv) => runAwait(argv),
  },
];
