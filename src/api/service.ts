/**
 * grpc-js service definitions built from the protobuf-es service descriptors:
 * there is no generated grpc-js code, so every method's path and its
 * (de)serializers come from here, for the server and the client alike.
 */
import type * as grpc from "@grpc/grpc-js";
import { type DescMessage, type DescService, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Health } from "../gen/grpc/health/v1/health_pb.js";
import { Sidecar } from "../gen/kvxfer/v1/sidecar_pb.js";

/** What grpc-js needs to call or serve one method. */
export interface MethodDef {
  readonly path: string;
  readonly requestStream: boolean;
  readonly responseStream: boolean;
  readonly requestSerialize: (value: unknown) => Buffer;
  readonly requestDeserialize: (bytes: Buffer) => unknown;
  readonly responseSerialize: (value: unknown) => Buffer;
  readonly responseDeserialize: (bytes: Buffer) => unknown;
  readonly originalName: string;
}

function codec(schema: DescMessage): {
  serialize: (value: unknown) => Buffer;
  deserialize: (bytes: Buffer) => unknown;
} {
  return {
    // Already-encoded bytes pass through: WatchEvents encodes each event once
    // for all its watchers.
    serialize: (value) => {
      const bytes =
        value instanceof Uint8Array
          ? value
          : toBinary(schema, value as Parameters<typeof toBinary>[1]);
      return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    },
    deserialize: (bytes) => fromBinary(schema, bytes),
  };
}

/** The grpc-js definition of a protobuf-es service, keyed by method name (e.g. "GetStatus"). */
export function serviceDefinition(service: DescService): Record<string, MethodDef> {
  const out: Record<string, MethodDef> = {};
  for (const m of service.methods) {
    const req = codec(m.input);
    const res = codec(m.output);
    out[m.name] = {
      path: `/${service.typeName}/${m.name}`,
      requestStream: m.methodKind === "client_streaming" || m.methodKind === "bidi_streaming",
      responseStream: m.methodKind === "server_streaming" || m.methodKind === "bidi_streaming",
      requestSerialize: req.serialize,
      requestDeserialize: req.deserialize,
      responseSerialize: res.serialize,
      responseDeserialize: res.deserialize,
      originalName: m.localName,
    };
  }
  return out;
}

export const sidecarService = serviceDefinition(Sidecar);
export const healthService = serviceDefinition(Health);

/** The definition of one method, by name; throws when the service has no such method. */
export function method(def: Record<string, MethodDef>, name: string): MethodDef {
  const m = def[name];
  if (m === undefined) throw new Error(`no method ${name}`);
  return m;
}

/** For `grpc.Server.addService`. */
export function asServiceDefinition(def: Record<string, MethodDef>): grpc.ServiceDefinition {
  return def as unknown as grpc.ServiceDefinition;
}

export const SIDECAR_SERVICE_NAME = Sidecar.typeName;
