/**
 * A small line chart as an SVG string: axes with ticks and labels, a legend,
 * linear or log-2 axes, one polyline with point markers per series. Enough
 * for the benchmark plots, with no dependency.
 */

export interface ChartSeries {
  name: string;
  /** (x, y) points; points with a non-finite or (on a log axis) non-positive coordinate are skipped. */
  points: ReadonlyArray<readonly [number, number]>;
  /** Dashed line: a reference measured in the same run. */
  dashed?: boolean;
  color?: string;
}

export interface LineChartOptions {
  title: string;
  subtitle?: string;
  xLabel: string;
  yLabel: string;
  series: readonly ChartSeries[];
  logX?: boolean;
  logY?: boolean;
  width?: number;
  height?: number;
  /** Tick positions on x (default: powers of two on a log axis, round numbers otherwise). */
  xTicks?: readonly number[];
  xTickFormat?: (x: number) => string;
  yTickFormat?: (y: number) => string;
}

const PALETTE = [
  "#1f77b4",
  "#d62728",
  "#2ca02c",
  "#ff7f0e",
  "#9467bd",
  "#8c564b",
  "#e377c2",
  "#17becf",
];

function esc(s: string): string {
  return s
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;");
}

/** Round-number ticks (1, 2, 5 × 10^k) covering [lo, hi], about `count` of them. */
export function linearTicks(lo: number, hi: number, count = 6): number[] {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = ([1, 2, 5, 10].find((m) => m * mag >= raw) ?? 10) * mag;
  const out: number[] = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step)
    out.push(Number(v.toPrecision(12)));
  return out;
}

/** Powers of two in [lo, hi], every 2^k-th so that there are at most `max`. */
export function log2Ticks(lo: number, hi: number, max = 9): number[] {
  const a = Math.floor(Math.log2(lo));
  const b = Math.ceil(Math.log2(hi));
  const stride = Math.max(1, Math.ceil((b - a + 1) / max));
  const out: number[] = [];
  for (let e = a; e <= b; e += stride) {
    const v = 2 ** e;
    if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
  }
  return out;
}

/** Compact numbers: 1.5k, 2M; small ones with up to 3 significant digits. */
export function shortNumber(v: number): string {
  const abs = Math.abs(v);
  if (abs >= 1e9) return `${+(v / 1e9).toPrecision(3)}G`;
  if (abs >= 1e6) return `${+(v / 1e6).toPrecision(3)}M`;
  // Whole numbers below 100k as they are (2048 tokens, not "2050").
  if (abs < 1e5 && Number.isInteger(v)) return String(v);
  if (abs >= 1e4) return `${+(v / 1e3).toPrecision(3)}k`;
  return `${+v.toPrecision(3)}`;
}

/** Byte sizes in binary units: 4K, 256K, 1M, 64M. */
export function shortBytes(v: number): string {
  if (v >= 2 ** 30) return `${+(v / 2 ** 30).toPrecision(3)}G`;
  if (v >= 2 ** 20) return `${+(v / 2 ** 20).toPrecision(3)}M`;
  if (v >= 2 ** 10) return `${+(v / 2 ** 10).toPrecision(3)}K`;
  return `${v}`;
}

export function lineChart(o: LineChartOptions): string {
  const width = o.width ?? 760;
  const height = o.height ?? 440;
  const legendWidth = 220;
  const m = {
    left: 70,
    right: legendWidth + 20,
    top: o.subtitle !== undefined ? 58 : 42,
    bottom: 56,
  };
  const pw = width - m.left - m.right;
  const ph = height - m.top - m.bottom;
  const okX = (x: number): boolean => Number.isFinite(x) && (!o.logX || x > 0);
  const okY = (y: number): boolean => Number.isFinite(y) && (!o.logY || y > 0);
  const pts = o.series.flatMap((s) => s.points.filter(([x, y]) => okX(x) && okY(y)));
  const xs = pts.map(([x]) => x);
  const ys = pts.map(([, y]) => y);
  let x0 = xs.length ? Math.min(...xs) : 1;
  let x1 = xs.length ? Math.max(...xs) : 2;
  if (x0 === x1) [x0, x1] = o.logX ? [x0 / 2, x1 * 2] : [x0 - 1, x1 + 1];
  let y0 = ys.length ? Math.min(...ys) : 0;
  let y1 = ys.length ? Math.max(...ys) : 1;
  if (!o.logY) {
    y0 = Math.min(0, y0);
    const t = linearTicks(y0, y1 * 1.05);
    y1 = Math.max(y1, t[t.length - 1] ?? y1);
  } else {
    y0 = 2 ** Math.floor(Math.log2(y0));
    y1 = 2 ** Math.ceil(Math.log2(y1));
  }
  if (y0 === y1) y1 = y0 + 1;
  const tx = (x: number): number => {
    const f = o.logX
      ? (Math.log(x) - Math.log(x0)) / (Math.log(x1) - Math.log(x0))
      : (x - x0) / (x1 - x0);
    return m.left + f * pw;
  };
  const ty = (y: number): number => {
    const f = o.logY
      ? (Math.log(y) - Math.log(y0)) / (Math.log(y1) - Math.log(y0))
      : (y - y0) / (y1 - y0);
    return m.top + ph - f * ph;
  };
  const xTicks = o.xTicks ?? (o.logX ? log2Ticks(x0, x1) : linearTicks(x0, x1));
  const yTicks = o.logY ? log2Ticks(y0, y1, 8) : linearTicks(y0, y1);
  const fx = o.xTickFormat ?? shortNumber;
  const fy = o.yTickFormat ?? shortNumber;
  const r = (v: number): string => v.toFixed(1);

  const out: string[] = [];
  out.push(
    `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="Helvetica, Arial, sans-serif" font-size="12">`,
    `<rect width="${width}" height="${height}" fill="#ffffff"/>`,
    `<text x="${m.left}" y="22" font-size="15" font-weight="bold">${esc(o.title)}</text>`,
  );
  if (o.subtitle !== undefined)
    out.push(`<text x="${m.left}" y="40" fill="#555555">${esc(o.subtitle)}</text>`);
  // Grid and ticks.
  for (const t of xTicks) {
    const x = r(tx(t));
    out.push(
      `<line x1="${x}" y1="${m.top}" x2="${x}" y2="${m.top + ph}" stroke="#e6e6e6"/>`,
      `<line x1="${x}" y1="${m.top + ph}" x2="${x}" y2="${m.top + ph + 5}" stroke="#333333"/>`,
      `<text x="${x}" y="${m.top + ph + 18}" text-anchor="middle">${esc(fx(t))}</text>`,
    );
  }
  for (const t of yTicks) {
    const y = r(ty(t));
    out.push(
      `<line x1="${m.left}" y1="${y}" x2="${m.left + pw}" y2="${y}" stroke="#e6e6e6"/>`,
      `<line x1="${m.left - 5}" y1="${y}" x2="${m.left}" y2="${y}" stroke="#333333"/>`,
      `<text x="${m.left - 8}" y="${y}" text-anchor="end" dominant-baseline="middle">${esc(fy(t))}</text>`,
    );
  }
  // Axes and their labels.
  out.push(
    `<rect x="${m.left}" y="${m.top}" width="${pw}" height="${ph}" fill="none" stroke="#333333"/>`,
    `<text x="${r(m.left + pw / 2)}" y="${height - 14}" text-anchor="middle">${esc(o.xLabel)}${o.logX ? " (log scale)" : ""}</text>`,
    `<text transform="translate(18 ${r(m.top + ph / 2)}) rotate(-90)" text-anchor="middle">${esc(o.yLabel)}${o.logY ? " (log scale)" : ""}</text>`,
  );
  // Series.
  o.series.forEach((s, i) => {
    const color = s.color ?? PALETTE[i % PALETTE.length]!;
    const p = s.points.filter(([x, y]) => okX(x) && okY(y)).sort((a, b) => a[0] - b[0]);
    const dash = s.dashed === true ? ` stroke-dasharray="6 4"` : "";
    if (p.length > 1)
      out.push(
        `<polyline fill="none" stroke="${color}" stroke-width="2"${dash} points="${p.map(([x, y]) => `${r(tx(x))},${r(ty(y))}`).join(" ")}"/>`,
      );
    for (const [x, y] of p)
      out.push(
        `<circle cx="${r(tx(x))}" cy="${r(ty(y))}" r="3.5" fill="${s.dashed === true ? "#ffffff" : color}" stroke="${color}" stroke-width="1.5"/>`,
      );
    // Legend entry.
    const ly = m.top + 8 + i * 20;
    const lx = m.left + pw + 16;
    out.push(
      `<line x1="${lx}" y1="${ly}" x2="${lx + 26}" y2="${ly}" stroke="${color}" stroke-width="2"${dash}/>`,
      `<circle cx="${lx + 13}" cy="${ly}" r="3.5" fill="${s.dashed === true ? "#ffffff" : color}" stroke="${color}" stroke-width="1.5"/>`,
      `<text x="${lx + 34}" y="${ly}" dominant-baseline="middle">${esc(s.name)}</text>`,
    );
  });
  out.push("</svg>");
  return out.join("\n") + "\n";
}
