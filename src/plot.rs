//! Small charts as PNG files, with nothing from the system: line charts (axes, ticks, grid,
//! labels, a legend, several series) for a run's metrics, and grouped bar charts (before/after
//! comparisons). Text comes from a built-in 5×7 bitmap font, pixels are palette indices, and the
//! PNG is encoded here: rows filtered with PNG's "up" filter, then zlib with one fixed-Huffman
//! deflate block whose only matches are runs (distance 1), which packs a chart's flat areas
//! well enough (an 800×480 chart is tens of kilobytes) without a compression library.

use anyhow::Result;
use std::path::Path;

/// The palette: background, ink, grid, axis grey, then series colours (Tableau 10's first
/// eight, which stay apart for most kinds of colour blindness).
pub const PALETTE: [[u8; 3]; 12] = [
    [255, 255, 255],
    [20, 20, 20],
    [225, 225, 225],
    [120, 120, 120],
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [23, 190, 207],
];
const BG: u8 = 0;
const INK: u8 = 1;
const GRID: u8 = 2;
const AXIS: u8 = 3;
const FIRST_SERIES: u8 = 4;

/// The colour of series `i`.
pub fn series_colour(i: usize) -> u8 {
    FIRST_SERIES + (i % (PALETTE.len() - FIRST_SERIES as usize)) as u8
}

/// An image of palette indices, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Canvas {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

/// Pixel scale of the font: each font dot is a `SCALE × SCALE` square.
const SCALE: i64 = 2;
/// Horizontal advance of one character, in pixels.
const ADVANCE: i64 = 6 * SCALE;
/// Height of a line of text, in pixels.
const TEXT_H: i64 = 7 * SCALE;

impl Canvas {
    pub fn new(width: usize, height: usize) -> Canvas {
        Canvas {
            width,
            height,
            pixels: vec![BG; width * height],
        }
    }

    pub fn get(&self, x: usize, y: usize) -> Option<u8> {
        (x < self.width && y < self.height).then(|| self.pixels[y * self.width + x])
    }

    pub fn set(&mut self, x: i64, y: i64, c: u8) {
        if x >= 0 && y >= 0 && (x as usize) < self.width && (y as usize) < self.height {
            self.pixels[y as usize * self.width + x as usize] = c;
        }
    }

    pub fn fill_rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: u8) {
        for y in y0.min(y1)..=y0.max(y1) {
            for x in x0.min(x1)..=x0.max(x1) {
                self.set(x, y, c);
            }
        }
    }

    /// A line `width` pixels wide (Bresenham, thickened with a square pen).
    pub fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), width: i64, c: u8) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        let lo = -(width - 1) / 2;
        let hi = width / 2;
        loop {
            self.fill_rect(x + lo, y + lo, x + hi, y + hi, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Copies `src` into this canvas with its top-left corner at `(x, y)` (clipped).
    pub fn blit(&mut self, src: &Canvas, x: usize, y: usize) {
        for sy in 0..src.height.min(self.height.saturating_sub(y)) {
            let w = src.width.min(self.width.saturating_sub(x));
            let from = &src.pixels[sy * src.width..sy * src.width + w];
            let at = (y + sy) * self.width + x;
            self.pixels[at..at + w].copy_from_slice(from);
        }
    }

    /// Text with its top-left corner at `(x, y)`.
    pub fn text(&mut self, x: i64, y: i64, s: &str, c: u8) {
        for (i, ch) in s.chars().enumerate() {
            let cols = glyph(ch);
            for (cx, col) in cols.iter().enumerate() {
                for cy in 0..7 {
                    if col >> cy & 1 == 1 {
                        let px = x + i as i64 * ADVANCE + cx as i64 * SCALE;
                        let py = y + cy * SCALE;
                        self.fill_rect(px, py, px + SCALE - 1, py + SCALE - 1, c);
                    }
                }
            }
        }
    }

    /// Text turned a quarter left (reading bottom to top), its run starting at `(x, y)` and
    /// going up.
    pub fn text_up(&mut self, x: i64, y: i64, s: &str, c: u8) {
        for (i, ch) in s.chars().enumerate() {
            let cols = glyph(ch);
            for (cx, col) in cols.iter().enumerate() {
                for cy in 0..7 {
                    if col >> cy & 1 == 1 {
                        let px = x + cy * SCALE;
                        let py = y - i as i64 * ADVANCE - cx as i64 * SCALE;
                        self.fill_rect(px, py - SCALE + 1, px + SCALE - 1, py, c);
                    }
                }
            }
        }
    }
}

/// Width of `s` in pixels.
pub fn text_width(s: &str) -> i64 {
    s.chars().count() as i64 * ADVANCE - SCALE
}

/// Tick positions for an axis over `[lo, hi]`: about `n` steps of 1, 2 or 5 × 10^k, and the range
/// widened to whole steps.
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> (f64, f64, Vec<f64>) {
    let (mut lo, mut hi) = if lo.is_finite() && hi.is_finite() {
        (lo.min(hi), lo.max(hi))
    } else {
        (0.0, 1.0)
    };
    if hi - lo < 1e-12 * lo.abs().max(1e-300) || hi == lo {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        lo -= pad;
        hi += pad;
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let (a, b) = ((lo / step).floor(), (hi / step).ceil());
    let ticks = (0..=((b - a) as i64).clamp(0, 100))
        .map(|i| (a + i as f64) * step)
        .collect();
    (a * step, b * step, ticks)
}

/// A tick label: as many decimals as the step needs; exponent form for very large or small.
pub fn tick_label(v: f64, step: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if v.abs() >= 1e5 || step.abs() < 1e-3 {
        return format!("{v:.1e}");
    }
    let decimals = (-step.abs().log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

/// The frame of a chart: where the plot area lies and how values map to pixels.
struct Frame {
    left: i64,
    right: i64,
    top: i64,
    bottom: i64,
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    fn px(&self, x: f64, y: f64) -> (i64, i64) {
        let fx = (x - self.x.0) / (self.x.1 - self.x.0);
        let fy = (y - self.y.0) / (self.y.1 - self.y.0);
        (
            self.left + (fx * (self.right - self.left) as f64).round() as i64,
            self.bottom - (fy * (self.bottom - self.top) as f64).round() as i64,
        )
    }
}

/// Title, legend and axes around the plot area; returns the frame. `x_ticks` as `(value,
/// label)`, or none for a category axis that the caller labels.
fn draw_frame(
    c: &mut Canvas,
    title: &str,
    legend: &[String],
    x_label: &str,
    y_label: &str,
    x: (f64, f64, Vec<f64>),
    y: (f64, f64, Vec<f64>),
) -> Frame {
    let (w, h) = (c.width as i64, c.height as i64);
    c.text((w - text_width(title)) / 2, 10, title, INK);
    // The legend: entries in rows under the title, each a colour swatch and its name.
    let mut lx = 70;
    let mut ly = 10 + TEXT_H + 10;
    for (i, name) in legend.iter().enumerate() {
        let entry = 26 + text_width(name) + 24;
        if lx + entry > w - 10 && lx > 70 {
            lx = 70;
            ly += TEXT_H + 6;
        }
        c.fill_rect(lx, ly + 4, lx + 19, ly + TEXT_H - 5, series_colour(i));
        c.text(lx + 26, ly, name, INK);
        lx += entry;
    }
    let y_step = y.2.get(1).zip(y.2.first()).map_or(1.0, |(b, a)| b - a);
    let y_labels: Vec<String> = y.2.iter().map(|v| tick_label(*v, y_step)).collect();
    let label_w = y_labels.iter().map(|s| text_width(s)).max().unwrap_or(0);
    let f = Frame {
        left: 14 + TEXT_H + 8 + label_w + 8,
        right: w - 24,
        top: ly + TEXT_H + 14,
        bottom: h - (TEXT_H * 2 + 24),
        x: (x.0, x.1),
        y: (y.0, y.1),
    };
    // Grid and y ticks.
    for (v, label) in y.2.iter().zip(&y_labels) {
        let (_, py) = f.px(f.x.0, *v);
        c.line((f.left, py), (f.right, py), 1, GRID);
        c.line((f.left - 5, py), (f.left, py), 1, AXIS);
        c.text(f.left - 8 - text_width(label), py - TEXT_H / 2, label, INK);
    }
    let x_step = x.2.get(1).zip(x.2.first()).map_or(1.0, |(b, a)| b - a);
    for v in &x.2 {
        let (px, _) = f.px(*v, f.y.0);
        c.line((px, f.top), (px, f.bottom), 1, GRID);
        c.line((px, f.bottom), (px, f.bottom + 5), 1, AXIS);
        let label = tick_label(*v, x_step);
        c.text(px - text_width(&label) / 2, f.bottom + 9, &label, INK);
    }
    c.line((f.left, f.top), (f.left, f.bottom), 1, AXIS);
    c.line((f.left, f.bottom), (f.right, f.bottom), 1, AXIS);
    c.text(
        (f.left + f.right - text_width(x_label)) / 2,
        h - TEXT_H - 8,
        x_label,
        INK,
    );
    c.text_up(
        12,
        (f.top + f.bottom + text_width(y_label)) / 2,
        y_label,
        INK,
    );
    f
}

/// A line chart of several series of `(x, y)` points. A series of a few points (validation
/// every N steps) is drawn with a square at each point as well as its line.
pub struct LineChart {
    title: String,
    x_label: String,
    y_label: String,
    series: Vec<(String, Vec<(f64, f64)>)>,
}

impl LineChart {
    pub fn new(title: &str, x_label: &str, y_label: &str) -> LineChart {
        LineChart {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series: Vec::new(),
        }
    }

    /// Adds a series; non-finite points are left out.
    pub fn series(&mut self, name: &str, points: Vec<(f64, f64)>) -> &mut Self {
        let points = points
            .into_iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        self.series.push((name.into(), points));
        self
    }

    pub fn is_empty(&self) -> bool {
        self.series.iter().all(|(_, p)| p.is_empty())
    }

    pub fn render(&self, width: usize, height: usize) -> Canvas {
        let mut c = Canvas::new(width, height);
        let all = self.series.iter().flat_map(|(_, p)| p.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in all {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        let xt = nice_ticks(x0, x1, 8);
        let yt = nice_ticks(y0, y1, 6);
        let names: Vec<String> = self.series.iter().map(|(n, _)| n.clone()).collect();
        let f = draw_frame(
            &mut c,
            &self.title,
            &names,
            &self.x_label,
            &self.y_label,
            xt,
            yt,
        );
        for (i, (_, points)) in self.series.iter().enumerate() {
            let colour = series_colour(i);
            let px: Vec<(i64, i64)> = points.iter().map(|&(x, y)| f.px(x, y)).collect();
            for pair in px.windows(2) {
                c.line(pair[0], pair[1], 2, colour);
            }
            if points.len() <= 60 {
                for &(x, y) in &px {
                    c.fill_rect(x - 3, y - 3, x + 3, y + 3, colour);
                }
            }
        }
        c
    }
}

/// Grouped bars: one group per category, one bar per series in each group.
pub struct BarChart {
    title: String,
    y_label: String,
    categories: Vec<String>,
    /// `(series name, one value per category)`.
    series: Vec<(String, Vec<f64>)>,
}

impl BarChart {
    pub fn new(title: &str, y_label: &str, categories: &[&str]) -> BarChart {
        BarChart {
            title: title.into(),
            y_label: y_label.into(),
            categories: categories.iter().map(|s| s.to_string()).collect(),
            series: Vec::new(),
        }
    }

    /// Adds a series with one value per category (missing ones draw no bar).
    pub fn series(&mut self, name: &str, values: Vec<f64>) -> &mut Self {
        self.series.push((name.into(), values));
        self
    }

    pub fn render(&self, width: usize, height: usize) -> Canvas {
        let mut c = Canvas::new(width, height);
        let values = self
            .series
            .iter()
            .flat_map(|(_, v)| v.iter())
            .filter(|v| v.is_finite());
        let (lo, hi) = values.fold((0.0f64, 0.0f64), |(a, b), v| (a.min(*v), b.max(*v)));
        let yt = nice_ticks(lo, if hi == lo { lo + 1.0 } else { hi }, 6);
        let groups = self.categories.len().max(1) as f64;
        let names: Vec<String> = self.series.iter().map(|(n, _)| n.clone()).collect();
        let f = draw_frame(
            &mut c,
            &self.title,
            &names,
            "",
            &self.y_label,
            (0.0, groups, vec![]),
            yt,
        );
        let per_group = (f.right - f.left) as f64 / groups;
        let bars = self.series.len().max(1) as f64;
        let bar_w = per_group * 0.8 / bars;
        for (g, name) in self.categories.iter().enumerate() {
            let g0 = f.left as f64 + g as f64 * per_group + per_group * 0.1;
            for (s, (_, vals)) in self.series.iter().enumerate() {
                let Some(&v) = vals.get(g).filter(|v| v.is_finite()) else {
                    continue;
                };
                let xa = (g0 + s as f64 * bar_w).round() as i64;
                let xb = (g0 + (s as f64 + 1.0) * bar_w).round() as i64 - 2;
                let (_, y_zero) = f.px(0.0, 0.0);
                let (_, y_v) = f.px(0.0, v);
                c.fill_rect(xa, y_zero, xb.max(xa), y_v, series_colour(s));
            }
            let cx = (g0 + per_group * 0.4).round() as i64;
            c.text(cx - text_width(name) / 2, f.bottom + 9, name, INK);
        }
        let (_, y_zero) = f.px(0.0, 0.0);
        c.line((f.left, y_zero), (f.right, y_zero), 1, AXIS);
        c
    }
}

// ---------------------------------------------------------------------------------------------
// PNG
// ---------------------------------------------------------------------------------------------

/// CRC-32 (ISO-HDLC, reflected polynomial 0xEDB88320), as PNG chunks carry.
pub fn crc32(data: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (i, t) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *t = c;
    }
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5552) {
        for &x in chunk {
            a += x as u32;
            b += a;
        }
        a %= 65521;
        b %= 65521;
    }
    b << 16 | a
}

/// Deflate's bit order: fields least significant bit first.
struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn put(&mut self, value: u32, count: u32) {
        self.acc |= (value as u64) << self.n;
        self.n += count;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }
    /// A Huffman code: sent most significant bit first.
    fn code(&mut self, code: u32, len: u32) {
        self.put(code.reverse_bits() >> (32 - len), len);
    }
    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

const LENGTH_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LENGTH_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];

/// zlib stream of `data`: one final fixed-Huffman block (RFC 1951 §3.2.6) of literals and runs
/// (a match at distance 1 repeats the previous byte 3-258 times).
pub fn zlib_rle(data: &[u8]) -> Vec<u8> {
    let mut bits = Bits {
        out: vec![0x78, 0x01],
        acc: 0,
        n: 0,
    };
    bits.put(1, 1); // BFINAL
    bits.put(1, 2); // BTYPE = fixed Huffman
    let literal = |bits: &mut Bits, v: u8| {
        if v < 144 {
            bits.code(0x30 + v as u32, 8)
        } else {
            bits.code(0x190 + (v as u32 - 144), 9)
        }
    };
    let mut i = 0;
    while i < data.len() {
        let run = if i > 0 {
            let prev = data[i - 1];
            data[i..]
                .iter()
                .take(258)
                .take_while(|&&b| b == prev)
                .count()
        } else {
            0
        };
        if run >= 3 {
            let k = LENGTH_BASE
                .iter()
                .rposition(|&b| b as usize <= run)
                .unwrap_or(0);
            let sym = 257 + k as u32;
            if sym < 280 {
                bits.code(sym - 256, 7);
            } else {
                bits.code(0xC0 + (sym - 280), 8);
            }
            bits.put(run as u32 - LENGTH_BASE[k] as u32, LENGTH_EXTRA[k] as u32);
            bits.code(0, 5); // distance code 0: distance 1
            i += run;
        } else {
            literal(&mut bits, data[i]);
            i += 1;
        }
    }
    bits.code(0, 7); // end of block (256)
    let mut out = bits.finish();
    out.extend_from_slice(&adler32(data).to_be_bytes());
    out
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// The PNG bytes of `c`: 8-bit palette colour, every row filtered "up".
pub fn encode_png(c: &Canvas) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(c.width as u32).to_be_bytes());
    ihdr.extend_from_slice(&(c.height as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 3, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    let plte: Vec<u8> = PALETTE.iter().flatten().copied().collect();
    chunk(&mut out, b"PLTE", &plte);
    let mut raw = Vec::with_capacity((c.width + 1) * c.height);
    for y in 0..c.height {
        raw.push(2); // filter: up
        let row = &c.pixels[y * c.width..(y + 1) * c.width];
        if y == 0 {
            raw.extend_from_slice(row);
        } else {
            let above = &c.pixels[(y - 1) * c.width..y * c.width];
            raw.extend(row.iter().zip(above).map(|(a, b)| a.wrapping_sub(*b)));
        }
    }
    chunk(&mut out, b"IDAT", &zlib_rle(&raw));
    chunk(&mut out, b"IEND", &[]);
    out
}

/// Writes `c` as a PNG file, whole (a temporary file renamed into place).
pub fn write_png(path: &Path, c: &Canvas) -> Result<()> {
    crate::atomic_file::write(path, &encode_png(c))
}

// ---------------------------------------------------------------------------------------------
// The font: 5×7, one byte per column, bit 0 at the top (the classic HD44780-style glyphs).
// ---------------------------------------------------------------------------------------------

const FONT: [[u8; 5]; 95] = [
    [0x00, 0x00, 0x00, 0x00, 0x00], // ' '
    [0x00, 0x00, 0x5F, 0x00, 0x00], // !
    [0x00, 0x07, 0x00, 0x07, 0x00], // "
    [0x14, 0x7F, 0x14, 0x7F, 0x14], // #
    [0x24, 0x2A, 0x7F, 0x2A, 0x12], // $
    [0x23, 0x13, 0x08, 0x64, 0x62], // %
    [0x36, 0x49, 0x55, 0x22, 0x50], // &
    [0x00, 0x05, 0x03, 0x00, 0x00], // '
    [0x00, 0x1C, 0x22, 0x41, 0x00], // (
    [0x00, 0x41, 0x22, 0x1C, 0x00], // )
    [0x14, 0x08, 0x3E, 0x08, 0x14], // *
    [0x08, 0x08, 0x3E, 0x08, 0x08], // +
    [0x00, 0x50, 0x30, 0x00, 0x00], // ,
    [0x08, 0x08, 0x08, 0x08, 0x08], // -
    [0x00, 0x60, 0x60, 0x00, 0x00], // .
    [0x20, 0x10, 0x08, 0x04, 0x02], // /
    [0x3E, 0x51, 0x49, 0x45, 0x3E], // 0
    [0x00, 0x42, 0x7F, 0x40, 0x00], // 1
    [0x42, 0x61, 0x51, 0x49, 0x46], // 2
    [0x21, 0x41, 0x45, 0x4B, 0x31], // 3
    [0x18, 0x14, 0x12, 0x7F, 0x10], // 4
    [0x27, 0x45, 0x45, 0x45, 0x39], // 5
    [0x3C, 0x4A, 0x49, 0x49, 0x30], // 6
    [0x01, 0x71, 0x09, 0x05, 0x03], // 7
    [0x36, 0x49, 0x49, 0x49, 0x36], // 8
    [0x06, 0x49, 0x49, 0x29, 0x1E], // 9
    [0x00, 0x36, 0x36, 0x00, 0x00], // :
    [0x00, 0x56, 0x36, 0x00, 0x00], // ;
    [0x08, 0x14, 0x22, 0x41, 0x00], // <
    [0x14, 0x14, 0x14, 0x14, 0x14], // =
    [0x00, 0x41, 0x22, 0x14, 0x08], // >
    [0x02, 0x01, 0x51, 0x09, 0x06], // ?
    [0x32, 0x49, 0x79, 0x41, 0x3E], // @
    [0x7E, 0x11, 0x11, 0x11, 0x7E], // A
    [0x7F, 0x49, 0x49, 0x49, 0x36], // B
    [0x3E, 0x41, 0x41, 0x41, 0x22], // C
    [0x7F, 0x41, 0x41, 0x22, 0x1C], // D
    [0x7F, 0x49, 0x49, 0x49, 0x41], // E
    [0x7F, 0x09, 0x09, 0x09, 0x01], // F
    [0x3E, 0x41, 0x49, 0x49, 0x7A], // G
    [0x7F, 0x08, 0x08, 0x08, 0x7F], // H
    [0x00, 0x41, 0x7F, 0x41, 0x00], // I
    [0x20, 0x40, 0x41, 0x3F, 0x01], // J
    [0x7F, 0x08, 0x14, 0x22, 0x41], // K
    [0x7F, 0x40, 0x40, 0x40, 0x40], // L
    [0x7F, 0x02, 0x0C, 0x02, 0x7F], // M
    [0x7F, 0x04, 0x08, 0x10, 0x7F], // N
    [0x3E, 0x41, 0x41, 0x41, 0x3E], // O
    [0x7F, 0x09, 0x09, 0x09, 0x06], // P
    [0x3E, 0x41, 0x51, 0x21, 0x5E], // Q
    [0x7F, 0x09, 0x19, 0x29, 0x46], // R
    [0x46, 0x49, 0x49, 0x49, 0x31], // S
    [0x01, 0x01, 0x7F, 0x01, 0x01], // T
    [0x3F, 0x40, 0x40, 0x40, 0x3F], // U
    [0x1F, 0x20, 0x40, 0x20, 0x1F], // V
    [0x3F, 0x40, 0x38, 0x40, 0x3F], // W
    [0x63, 0x14, 0x08, 0x14, 0x63], // X
    [0x07, 0x08, 0x70, 0x08, 0x07], // Y
    [0x61, 0x51, 0x49, 0x45, 0x43], // Z
    [0x00, 0x7F, 0x41, 0x41, 0x00], // [
    [0x02, 0x04, 0x08, 0x10, 0x20], // backslash
    [0x00, 0x41, 0x41, 0x7F, 0x00], // ]
    [0x04, 0x02, 0x01, 0x02, 0x04], // ^
    [0x40, 0x40, 0x40, 0x40, 0x40], // _
    [0x00, 0x01, 0x02, 0x04, 0x00], // `
    [0x20, 0x54, 0x54, 0x54, 0x78], // a
    [0x7F, 0x48, 0x44, 0x44, 0x38], // b
    [0x38, 0x44, 0x44, 0x44, 0x20], // c
    [0x38, 0x44, 0x44, 0x48, 0x7F], // d
    [0x38, 0x54, 0x54, 0x54, 0x18], // e
    [0x08, 0x7E, 0x09, 0x01, 0x02], // f
    [0x0C, 0x52, 0x52, 0x52, 0x3E], // g
    [0x7F, 0x08, 0x04, 0x04, 0x78], // h
    [0x00, 0x44, 0x7D, 0x40, 0x00], // i
    [0x20, 0x40, 0x44, 0x3D, 0x00], // j
    [0x7F, 0x10, 0x28, 0x44, 0x00], // k
    [0x00, 0x41, 0x7F, 0x40, 0x00], // l
    [0x7C, 0x04, 0x18, 0x04, 0x78], // m
    [0x7C, 0x08, 0x04, 0x04, 0x78], // n
    [0x38, 0x44, 0x44, 0x44, 0x38], // o
    [0x7C, 0x14, 0x14, 0x14, 0x08], // p
    [0x08, 0x14, 0x14, 0x18, 0x7C], // q
    [0x7C, 0x08, 0x04, 0x04, 0x08], // r
    [0x48, 0x54, 0x54, 0x54, 0x20], // s
    [0x04, 0x3F, 0x44, 0x40, 0x20], // t
    [0x3C, 0x40, 0x40, 0x20, 0x7C], // u
    [0x1C, 0x20, 0x40, 0x20, 0x1C], // v
    [0x3C, 0x40, 0x30, 0x40, 0x3C], // w
    [0x44, 0x28, 0x10, 0x28, 0x44], // x
    [0x0C, 0x50, 0x50, 0x50, 0x3C], // y
    [0x44, 0x64, 0x54, 0x4C, 0x44], // z
    [0x00, 0x08, 0x36, 0x41, 0x00], // {
    [0x00, 0x00, 0x7F, 0x00, 0x00], // |
    [0x00, 0x41, 0x36, 0x08, 0x00], // }
    [0x08, 0x04, 0x08, 0x10, 0x08], // ~
];

/// The columns of `ch`; characters outside printable ASCII draw as `?`.
fn glyph(ch: char) -> [u8; 5] {
    let i = (ch as u32).wrapping_sub(32) as usize;
    *FONT.get(i).unwrap_or(&FONT[31])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inflates the one kind of stream `zlib_rle` writes (a fixed-Huffman block whose matches
    /// are at distance 1), checking its header and Adler-32.
    fn inflate_fixed(z: &[u8]) -> Vec<u8> {
        assert_eq!(&z[..2], &[0x78, 0x01]);
        let body = &z[2..z.len() - 4];
        let mut pos = 0usize;
        let mut bit = || {
            let b = body[pos / 8] >> (pos % 8) & 1;
            pos += 1;
            b as u32
        };
        assert_eq!(bit(), 1, "BFINAL");
        assert_eq!(bit() | bit() << 1, 1, "BTYPE fixed");
        let mut out: Vec<u8> = Vec::new();
        loop {
            let mut code = 0;
            for _ in 0..7 {
                code = code << 1 | bit();
            }
            let sym = if code <= 23 {
                256 + code
            } else {
                code = code << 1 | bit();
                if (0x30..=0xBF).contains(&code) {
                    code - 0x30
                } else if (0xC0..=0xC7).contains(&code) {
                    280 + code - 0xC0
                } else {
                    code = code << 1 | bit();
                    144 + code - 0x190
                }
            };
            match sym {
                0..=255 => out.push(sym as u8),
                256 => break,
                _ => {
                    let k = (sym - 257) as usize;
                    let mut extra = 0;
                    for i in 0..LENGTH_EXTRA[k] {
                        extra |= bit() << i;
                    }
                    let len = LENGTH_BASE[k] as u32 + extra;
                    let mut dist = 0;
                    for _ in 0..5 {
                        dist = dist << 1 | bit();
                    }
                    assert_eq!(dist, 0, "only distance 1 is written");
                    let last = *out.last().unwrap();
                    out.extend(std::iter::repeat_n(last, len as usize));
                }
            }
        }
        assert_eq!(&z[z.len() - 4..], &adler32(&out).to_be_bytes());
        out
    }

    #[test]
    fn zlib_round_trips_runs_and_literals() {
        let mut data = vec![7u8; 1000];
        data.extend((0..=255u8).cycle().take(700));
        data.extend([0u8; 3]);
        data.extend([200u8; 259]);
        data.push(1);
        let z = zlib_rle(&data);
        assert!(z.len() < 1200, "runs should pack: {} bytes", z.len());
        assert_eq!(inflate_fixed(&z), data);
    }

    #[test]
    fn checksums_match_their_check_values() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    /// Parses a PNG back (chunks, CRCs, the "up" filter) into its pixels.
    fn decode_png(png: &[u8]) -> Canvas {
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let (mut pos, mut w, mut h, mut idat) = (8, 0, 0, Vec::new());
        while pos < png.len() {
            let len = u32::from_be_bytes(png[pos..pos + 4].try_into().unwrap()) as usize;
            let kind = &png[pos + 4..pos + 8];
            let data = &png[pos + 8..pos + 8 + len];
            let crc = u32::from_be_bytes(png[pos + 8 + len..pos + 12 + len].try_into().unwrap());
            assert_eq!(crc, crc32(&png[pos + 4..pos + 8 + len]), "CRC of {kind:?}");
            match kind {
                b"IHDR" => {
                    w = u32::from_be_bytes(data[..4].try_into().unwrap()) as usize;
                    h = u32::from_be_bytes(data[4..8].try_into().unwrap()) as usize;
                    assert_eq!(&data[8..], &[8, 3, 0, 0, 0]);
                }
                b"PLTE" => assert_eq!(data.len(), PALETTE.len() * 3),
                b"IDAT" => idat.extend_from_slice(data),
                _ => {}
            }
            pos += 12 + len;
        }
        let raw = inflate_fixed(&idat);
        assert_eq!(raw.len(), (w + 1) * h);
        let mut c = Canvas::new(w, h);
        for y in 0..h {
            assert_eq!(raw[y * (w + 1)], 2);
            for x in 0..w {
                let up = if y > 0 { c.pixels[(y - 1) * w + x] } else { 0 };
                c.pixels[y * w + x] = raw[y * (w + 1) + 1 + x].wrapping_add(up);
            }
        }
        c
    }

    #[test]
    fn a_line_chart_round_trips_through_png_and_draws_its_series() {
        let mut chart = LineChart::new("Loss", "step", "loss");
        chart.series(
            "train",
            (1..=50).map(|s| (s as f64, 1.0 / s as f64)).collect(),
        );
        chart.series("valid", vec![(10.0, 0.5), (50.0, 0.2)]);
        let c = chart.render(640, 400);
        let back = decode_png(&encode_png(&c));
        assert_eq!(back, c);
        let count = |colour: u8| c.pixels.iter().filter(|&&p| p == colour).count();
        // Both series, the title and the axes left pixels of their colours.
        assert!(count(series_colour(0)) > 500, "{}", count(series_colour(0)));
        assert!(count(series_colour(1)) > 100, "{}", count(series_colour(1)));
        assert!(count(INK) > 500 && count(AXIS) > 500);
    }

    #[test]
    fn bars_rise_from_zero_to_their_values() {
        let mut chart = BarChart::new("Before / after", "accuracy", &["acc", "margin"]);
        chart.series("before", vec![0.5, -0.2]);
        chart.series("after", vec![1.0, 0.4]);
        let c = chart.render(400, 300);
        // The longest unbroken vertical run of a colour (the legend's swatch is a short one).
        let height = |colour: u8| {
            let mut best = 0;
            for x in 0..c.width {
                let mut run = 0;
                for y in 0..c.height {
                    run = if c.get(x, y) == Some(colour) {
                        run + 1
                    } else {
                        0
                    };
                    best = best.max(run);
                }
            }
            best
        };
        // The tallest "after" bar (1.0) is twice the tallest "before" bar (0.5), within a pixel
        // of rounding at each end.
        let (b, a) = (
            height(series_colour(0)) as i64,
            height(series_colour(1)) as i64,
        );
        assert!((a - 2 * b).abs() <= 3, "before {b} px, after {a} px");
    }

    #[test]
    fn ticks_are_round_numbers_covering_the_range() {
        let (lo, hi, t) = nice_ticks(0.13, 0.92, 6);
        assert_eq!((lo, hi), (0.0, 1.0));
        assert_eq!(t.len(), 6);
        assert!((t[3] - 0.6).abs() < 1e-12);
        assert_eq!(tick_label(0.30000000000000004, 0.1), "0.3");
        assert_eq!(tick_label(2.5e-5, 1e-5), "2.5e-5");
        let (lo, hi, _) = nice_ticks(3.0, 3.0, 6);
        assert!(lo < 3.0 && hi > 3.0);
    }
}
