// A StrykerJS ignorer: no mutants inside calls to a logger (`log.debug(...)`, `ctx.log.warn(...)`,
// `this.host.log.error(...)`), nor in the `why` of a lifecycle move (the last argument of
// `begin(lc, t, state, why)` and `transition(lc, t, to, why)`, which only a debug line and the
// text of a refused move carry). Both are read by people only; a mutant there changes no
// behaviour a test could or should assert. Refusal texts, noted errors, events and the reasons
// transfers end with are not logs and stay mutated. Registered in stryker.config.mjs
// (`appendPlugins`, `ignorers`).
import { PluginKind, declareValuePlugin } from "@stryker-mutator/api/plugin";

const LEVELS = new Set(["trace", "debug", "info", "warn", "error", "fatal"]);

/** True for `log`, `x.log`, `this.x.log`: the object a log level is called on. */
function isLogger(node) {
  if (node.type === "Identifier") return node.name === "log";
  return (
    node.type === "MemberExpression" &&
    !node.computed &&
    node.property.type === "Identifier" &&
    node.property.name === "log"
  );
}

export const strykerPlugins = [
  declareValuePlugin(PluginKind.Ignore, "log-calls", {
    shouldIgnore(path) {
      const node = path.node;
      const parent = path.parent;
      if (
        parent?.type === "CallExpression" &&
        parent.callee.type === "Identifier" &&
        (parent.callee.name === "transition" || parent.callee.name === "begin") &&
        parent.arguments.length === 4 &&
        parent.arguments[3] === node
      )
        return "the why of a lifecycle move: read by people only";
      if (node.type !== "CallExpression") return undefined;
      const callee = node.callee;
      if (
        callee.type === "MemberExpression" &&
        !callee.computed &&
        callee.property.type === "Identifier" &&
        LEVELS.has(callee.property.name) &&
        isLogger(callee.object)
      )
        return "a log call: read by people only";
      return undefined;
    },
  }),
];
