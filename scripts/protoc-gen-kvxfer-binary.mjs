#!/usr/bin/env node
// A protobuf-es plugin (@bufbuild/protoplugin) that writes, next to each `<file>_pb.ts`, a
// `<file>_binary.ts` with one straight-line encoder per message: `<message>ToBinary(init)` gives
// the bytes `toBinary(Schema, create(Schema, init))` gives, without `create` and without the
// runtime's per-field writer closures, which cost tens of µs per message when their code has gone
// cold (docs/benchmarks.md). Run by `npm run gen` (buf.gen.yaml), checked by `npm run gen:check`;
// test/codec/binary.test.ts holds every encoder to protobuf-es over random values.
//
// Rules, the same as protobuf-es's toBinary: fields in field-number order; an implicit-presence
// field left out at its zero value (an init's undefined is its zero value); proto3 packed
// repeated scalars; a message field written when set, even empty. A message with a map field is
// handed to protobuf-es whole. Unknown fields are not written (an init has none). A value the
// writer refuses (e.g. a fraction in a uint32) sends the message to protobuf-es, whose error names
// the field.
import { createEcmaScriptPlugin, runNodeJs } from "@bufbuild/protoplugin";
import { ScalarType } from "@bufbuild/protobuf";

const WIRE = { varint: "Varint", bit64: "Bit64", ld: "LengthDelimited", bit32: "Bit32" };

/** Names a field's local copy may not take (the parameters and what the file imports). */
const taken = (name) =>
  ["w", "m", "v", "create", "toBinary", "BinaryWriter", "WireType"].includes(name) ||
  /Schema$|^write/.test(name);

/** The BinaryWriter method and wire type of each scalar type. */
const SCALAR = {
  [ScalarType.DOUBLE]: ["double", WIRE.bit64],
  [ScalarType.FLOAT]: ["float", WIRE.bit32],
  [ScalarType.INT64]: ["int64", WIRE.varint],
  [ScalarType.UINT64]: ["uint64", WIRE.varint],
  [ScalarType.INT32]: ["int32", WIRE.varint],
  [ScalarType.FIXED64]: ["fixed64", WIRE.bit64],
  [ScalarType.FIXED32]: ["fixed32", WIRE.bit32],
  [ScalarType.BOOL]: ["bool", WIRE.varint],
  [ScalarType.STRING]: ["string", WIRE.ld],
  [ScalarType.BYTES]: ["bytes", WIRE.ld],
  [ScalarType.UINT32]: ["uint32", WIRE.varint],
  [ScalarType.SFIXED32]: ["sfixed32", WIRE.bit32],
  [ScalarType.SFIXED64]: ["sfixed64", WIRE.bit64],
  [ScalarType.SINT32]: ["sint32", WIRE.varint],
  [ScalarType.SINT64]: ["sint64", WIRE.varint],
};

const IMPLICIT = 2;

const lowerFirst = (s) => s.charAt(0).toLowerCase() + s.slice(1);
/** `kvxfer.v1.Foo.Bar` -> `Foo_Bar`, as protoc-gen-es names it. */
const localName = (desc) =>
  desc.typeName.slice(desc.file.proto.package.length + 1).replace(/\./g, "_");
const writerName = (desc) => `write${localName(desc)}`;
const binaryFile = (file) => `${file.name}_binary`;

function* messagesOf(container) {
  for (const m of container.kind === "file" ? container.messages : container.nestedMessages) {
    yield m;
    yield* messagesOf(m);
  }
}

/** The zero test of an implicit-presence singular value `v` (already known defined). */
function nonZero(field, v) {
  if (field.fieldKind === "enum") return `${v} !== ${field.enum.values[0].number}`;
  switch (field.scalar) {
    case ScalarType.BOOL:
      return `${v} !== false`;
    case ScalarType.STRING:
      return `${v} !== ""`;
    case ScalarType.BYTES:
      return `${v}.byteLength > 0`;
    case ScalarType.DOUBLE:
    case ScalarType.FLOAT:
      return `!Object.is(${v}, 0)`;
    case ScalarType.INT64:
    case ScalarType.UINT64:
    case ScalarType.SINT64:
    case ScalarType.FIXED64:
    case ScalarType.SFIXED64:
      return field.longAsString ? `${v} !== "0"` : `${v} !== 0n`;
    default:
      return `${v} !== 0`;
  }
}

function generateTs(schema) {
  for (const file of schema.files) {
    const f = schema.generateFile(`${binaryFile(file)}.ts`);
    f.preamble(file);
    const BinaryWriter = f.import("BinaryWriter", "@bufbuild/protobuf/wire");
    const WireType = f.import("WireType", "@bufbuild/protobuf/wire");
    const tag = (n, wire) => [`w.tag(${n}, `, WireType, `.${wire})`];
    const { create, toBinary } = f.runtime;
    const MessageInitShape = f.import("MessageInitShape", "@bufbuild/protobuf", true);

    /** The function that writes message `desc`'s fields (another file's imported). */
    const writerOf = (desc) => {
      if (desc.file === file) return writerName(desc);
      // A path from the output folder's root; protoplugin makes it relative to this file.
      return f.import(writerName(desc), `./${binaryFile(desc.file)}.js`);
    };

    /** Statements writing one value `v` of `field` (a list's element), for one `print`. */
    const writeValue = (field, v, indent) => {
      const n = field.number;
      const kind = field.fieldKind === "list" ? field.listKind : field.fieldKind;
      if (kind === "message") {
        const w = writerOf(field.message);
        return [
          indent,
          ...tag(n, WIRE.ld),
          `.fork();\n`,
          indent,
          w,
          `(w, ${v});\n`,
          indent,
          `w.join();`,
        ];
      }
      if (kind === "enum") return [indent, ...tag(n, WIRE.varint), `.int32(${v});`];
      const [method, wire] = SCALAR[field.scalar];
      return [indent, ...tag(n, wire), `.${method}(${v});`];
    };

    for (const message of messagesOf(file)) {
      const Schema = f.importSchema(message);
      const name = localName(message);
      const init = [MessageInitShape, `<typeof `, Schema, `>`];
      f.print(f.jsDoc(`Writes ${message.typeName}'s fields into \`w\`, as toBinary would.`));
      f.print(
        f.export("function", writerName(message)),
        `(w: `,
        BinaryWriter,
        `, m: `,
        ...init,
        `): void {`,
      );
      if (message.fields.some((fd) => fd.fieldKind === "map")) {
        f.print(`  w.raw(`, toBinary, `(`, Schema, `, `, create, `(`, Schema, `, m)));`);
      } else {
        const sorted = [...message.fields].sort((a, b) => a.number - b.number);
        for (const field of sorted) {
          const name = taken(field.localName) ? `${field.localName}_` : field.localName;
          const from = `m.${field.localName}`;
          if (field.oneof !== undefined) {
            const o = `m.${field.oneof.localName}`;
            f.print(`  if (${o}?.case === "${field.localName}") {`);
            f.print(...writeValue(field, `${o}.value`, "    "));
            f.print(`  }`);
          } else if (field.fieldKind === "list") {
            f.print(`  const ${name} = ${from};`);
            f.print(`  if (${name} !== undefined && ${name}.length > 0) {`);
            if (field.packed) {
              const method = field.listKind === "enum" ? "int32" : SCALAR[field.scalar][0];
              f.print(`    `, ...tag(field.number, WIRE.ld), `.fork();`);
              f.print(`    for (const v of ${name}) w.${method}(v);`);
              f.print(`    w.join();`);
            } else {
              f.print(`    for (const v of ${name}) {`);
              f.print(...writeValue(field, "v", "      "));
              f.print(`    }`);
            }
            f.print(`  }`);
          } else {
            f.print(`  const ${name} = ${from};`);
            const present =
              field.fieldKind === "message" || field.presence !== IMPLICIT
                ? `${name} !== undefined`
                : `${name} !== undefined && ${nonZero(field, name)}`;
            f.print(`  if (${present}) {`);
            f.print(...writeValue(field, name, "    "));
            f.print(`  }`);
          }
        }
      }
      f.print(`}`);
      f.print();
      f.print(
        f.jsDoc(
          `${message.typeName} as bytes: what \`toBinary(${name}Schema, create(${name}Schema, m))\` writes.`,
        ),
      );
      f.print(
        f.export("function", `${lowerFirst(name)}ToBinary`),
        `(m: `,
        ...init,
        `): Uint8Array {`,
      );
      f.print(`  try {`);
      f.print(`    const w = new `, BinaryWriter, `();`);
      f.print(`    `, writerName(message), `(w, m);`);
      f.print(`    return w.finish();`);
      f.print(`  } catch {`);
      f.print(`    // protobuf-es says which field is wrong.`);
      f.print(`    return `, toBinary, `(`, Schema, `, `, create, `(`, Schema, `, m));`);
      f.print(`  }`);
      f.print(`}`);
      f.print();
    }
  }
}

runNodeJs(
  createEcmaScriptPlugin({
    name: "protoc-gen-kvxfer-binary",
    version: "v1",
    generateTs,
  }),
);
