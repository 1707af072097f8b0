import { describe, expect, it } from "vitest";
import { Agent } from "../src/native/index.js";

describe("smoke", () => {
  it("writes and reads between two agents in one process", async () => {
    const a = new Agent({ name: "a", transports: "shm,self" });
    const b = new Agent({ name: "b", transports: "shm,self" });
    const src = Buffer.alloc(1 << 20);
    for (let i = 0; i < src.length; i++) src[i] = (i * 7) & 0xff;
    const dst = Buffer.alloc(1 << 20);
    const ra = a.registerMemory(src);
    const rb = b.registerMemory(dst);
    const ep = a.connect(b.address);
    const remote = ep.importRemote(rb.remoteKey());
    const got: string[] = [];
    b.on("notifications", (batch) => { for (const n of batch) got.push(`${n.peer}:${n.data.toString()}`); });
    await a.write(ep, ra, remote, new Float64Array([0, 0, src.length]), Buffer.from("done"));
    expect(dst.equals(src)).toBe(true);
    for (let i = 0; i < 50 && got.length === 0; i++) await new Promise((r) => setTimeout(r, 10));
    expect(got).toEqual(["a:done"]);
    src.fill(0);
    await a.read(ep, ra, remote, new Float64Array([0, 0, 4096]));
    expect(src.subarray(0, 4096).equals(dst.subarray(0, 4096))).toBe(true);
    a.close(); b.close();
  });
});
