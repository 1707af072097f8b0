// Module resolve hook registered by typescript-hook.mjs: `typescript` (and its subpaths) asked
// for by a module of @stryker-mutator resolves from this folder, where TypeScript 6 is installed.
const here = new URL("./package.json", import.meta.url).href;

export async function resolve(specifier, context, nextResolve) {
  const fromStryker = context.parentURL?.includes("/node_modules/@stryker-mutator/") ?? false;
  if (fromStryker && (specifier === "typescript" || specifier.startsWith("typescript/"))) {
    return nextResolve(specifier, { ...context, parentURL: here });
  }
  return nextResolve(specifier, context);
}
