/**
 * grpc.health.v1.Health's handlers. Not grpc-health-check's `HealthImplementation` (2.1.0, looked
 * at for issue 49): it keeps every Watch stream in an unbounded set, so one client could hold
 * any number open (the attack of issue 48 that `healthShares` caps per client), and it loads
 * the proto at run time through @grpc/proto-loader beside the generated @bufbuild/protobuf
 * codecs every other service here uses.
 */
import * as grpc from "@grpc/grpc-js";
import { create } from "@bufbuild/protobuf";
import {
  type HealthCheckRequest,
  HealthCheckResponseSchema,
  HealthCheckResponse_ServingStatus as ServingStatus,
} from "../gen/grpc/health/v1/health_pb.js";
import { SIDECAR_SERVICE_NAME } from "./service.js";
import { ApiState, fail, type HealthWatch } from "./api-state.js";
import { callClient } from "./call-shares.js";

/** grpc.health.v1.Health: Check and Watch, and the serving state they report. */
export class HealthRpcs {
  constructor(private readonly s: ApiState) {}

  /** The handlers grpc-js calls, by method name. */
  handlers(): grpc.UntypedServiceImplementation {
    return { Check: this.check.bind(this), Watch: this.watch.bind(this) };
  }

  /** SERVING or NOT_SERVING for "" and the Sidecar service; undefined for any other. */
  private status(service: string): ServingStatus | undefined {
    if (service !== "" && service !== SIDECAR_SERVICE_NAME) return undefined;
    return this.s.serving ? ServingStatus.SERVING : ServingStatus.NOT_SERVING;
  }

  private answer(call: HealthWatch): void {
    call.write(
      create(HealthCheckResponseSchema, {
        status: this.status(call.request.service) ?? ServingStatus.SERVICE_UNKNOWN,
      }),
    );
  }

  check(
    call: grpc.ServerUnaryCall<HealthCheckRequest, unknown>,
    cb: grpc.sendUnaryData<unknown>,
  ): void {
    this.s.callSeen(call);
    const status = this.status(call.request.service);
    if (status === undefined)
      return cb(fail(grpc.status.NOT_FOUND, `unknown service '${call.request.service}'`));
    cb(null, create(HealthCheckResponseSchema, { status }));
  }

  watch(call: HealthWatch): void {
    this.s.callSeen(call);
    if (this.s.closing)
      return void call.emit("error", fail(grpc.status.UNAVAILABLE, "shutting down"));
    const client = callClient(call);
    const room = this.s.healthShares.admit(call, client);
    if ("refused" in room)
      return void call.emit("error", fail(grpc.status.RESOURCE_EXHAUSTED, room.refused));
    if (room.displaced !== undefined) {
      this.s.healthWatches.delete(room.displaced);
      room.displaced.emit(
        "error",
        fail(
          grpc.status.RESOURCE_EXHAUSTED,
          `displaced: every Health Watch stream is taken and this client holds the most; ${client.name} needed one`,
        ),
      );
    }
    this.s.healthWatches.add(call);
    this.answer(call);
    const done = (): void => {
      this.s.healthWatches.delete(call);
      this.s.healthShares.delete(call);
    };
    call.on("cancelled", done);
    call.on("error", done);
  }

  setServing(next: boolean): void {
    if (next === this.s.serving) return;
    this.s.serving = next;
    this.s.log.info({ serving: next }, "health changed");
    for (const call of this.s.healthWatches) this.answer(call);
  }

  /** Ends every Health/Watch stream (server stopping). */
  endAll(): void {
    for (const call of this.s.healthWatches) {
      this.s.healthShares.delete(call);
      call.end();
    }
    this.s.healthWatches.clear();
  }
}
