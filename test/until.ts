/**
 * The tests' one bounded wait: resolves once `pred` holds (a sync or async check, tried every
 * `everyMs`), and fails after `timeoutMs` naming what it waited for.
 */
export async function until(
  pred: () => boolean | Promise<boolean>,
  timeoutMs = 10_000,
  what: string | (() => string) = "condition",
  everyMs = 5,
): Promise<void> {
  const end = Date.now() + timeoutMs;
  for (;;) {
    if (await pred()) return;
    if (Date.now() > end) {
      const w = typeof what === "string" ? what : what();
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${w}`);
    }
    await new Promise((r) => setTimeout(r, everyMs));
  }
}
