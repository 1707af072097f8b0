/** What `startApiServer` takes and returns. */
import { type Logger } from "pino";
import type { EventLog } from "../sidecar/event-log.js";
import type { SidecarView } from "../sidecar/view.js";

export interface ApiTlsOptions {
  /** PEM server certificate chain. */
  readonly cert: Buffer | string;
  /** PEM private key. */
  readonly key: Buffer | string;
  /** PEM CA bundle that client certificates must chain to (mutual TLS). */
  readonly ca?: Buffer | string;
  /** Refuse clients without a certificate signed by `ca`. Default: true when `ca` is given. */
  readonly requireClientCert?: boolean;
}

export interface ApiServerOptions {
  readonly view: SidecarView;
  readonly events: EventLog;
  /** "host:port"; default "127.0.0.1:0" (loopback, any free port). */
  readonly address?: string;
  readonly tls?: ApiTlsOptions;
  /** The server logs under a child `{ component: "api" }`. Default: silent. */
  readonly logger?: Logger;
  /** Longest AwaitTransfer wait when the call has no (or a later) deadline. Default 300 000. */
  readonly maxAwaitMs?: number;
  /** How often a filtered watcher is told how far the server has looked. Default 5 000. */
  readonly progressIntervalMs?: number;
  /** Live events that may wait for one watcher before it is ended (RESOURCE_EXHAUSTED). */
  readonly watchBufferLimit?: number;
  /** Most concurrent WatchEvents streams; more get RESOURCE_EXHAUSTED. Default 1 000. */
  readonly maxWatchers?: number;
  /**
   * Most WatchEvents streams from one client address: the rest of maxWatchers stays free for
   * other clients (routers). Default maxWatchers / 4.
   */
  readonly maxWatchersPerClient?: number;
  /**
   * Most AwaitTransfer calls waiting at once (default 8 192), and from one client (its mutual
   * TLS identity, else its address group; default a quarter). When all are taken, a client with
   * fewer takes the place of the largest one's oldest (RESOURCE_EXHAUSTED to it).
   */
  readonly maxAwaits?: number;
  readonly maxAwaitsPerClient?: number;
  /** Most Health Watch streams at once (default 1 000; a quarter per client). */
  readonly maxHealthWatches?: number;
  /**
   * Connections at once before their first call, and after it (each pool; default 256); one
   * client's (identity or address group) connections with calls, at most (default 32). Nobody
   * is refused at accept: past the room, the oldest of the largest group is closed.
   */
  readonly maxConnections?: number;
  readonly maxConnectionsPerClient?: number;
  /** Concurrent streams on one HTTP/2 connection (SETTINGS_MAX_CONCURRENT_STREAMS; default 128). */
  readonly maxStreamsPerConnection?: number;
  /**
   * A connection with no call for this long is closed (GOAWAY; a client reconnects when it
   * next calls). Default 60 000.
   */
  readonly maxConnectionIdleMs?: number;
  /** A connection that makes no call this long after accept is closed. Default 10 000. */
  readonly silentConnectionMs?: number;
  /**
   * Health at start. Default true; the sidecar starts NOT_SERVING and turns SERVING once its
   * engine has registered (readiness), see `setServing`.
   */
  readonly serving?: boolean;
}

export interface ApiServer {
  readonly port: number;
  /** "host:port" actually bound. */
  readonly address: string;
  readonly serving: boolean;
  /** Open WatchEvents streams. */
  readonly watchers: number;
  /** AwaitTransfer calls waiting. */
  readonly awaiting: number;
  /** Open connections (each holds one of its slots). */
  readonly connections: number;
  /**
   * Health of both "" and "kvxfer.v1.Sidecar": SERVING or NOT_SERVING. The
   * sidecar is NOT_SERVING until its engine has registered (it cannot answer
   * handshakes before), SERVING after, and calls setServing(false) when it starts
   * draining (SIGTERM); the
   * Sidecar service itself keeps answering, so routers still learn how the
   * in-flight transfers end.
   */
  setServing(serving: boolean): void;
  /** NOT_SERVING; the same as setServing(false). */
  drain(): void;
  /**
   * Ends open streams (UNAVAILABLE) and waits, then stops the server; after
   * `graceMs` (default 5 000) whatever is left is cut.
   */
  close(graceMs?: number): Promise<void>;
}
