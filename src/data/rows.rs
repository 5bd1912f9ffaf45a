//! Dataset files as a stream of JSON rows (and a dataset setting as its files: one, or the
//! shards a pattern names, [`dataset_files`]), whatever the file holds: JSONL, one JSON array of rows,
//! CSV or TSV with a header, or Parquet; JSONL, JSON and CSV also gzip- or zstd-compressed. Every
//! reader of rows (training, `lint`, `eval`, `curate`) goes through [`Rows`], so a format read
//! here is read everywhere, with the same locations in its messages: `file:LINE` for JSONL and
//! CSV (a CSV record's first line), `file: row N` for Parquet and JSON arrays (a minified array
//! is one line).
//!
//! The format comes from the file's first bytes where they tell (Parquet's `PAR1`, gzip's and
//! zstd's magic numbers, JSON's `[` or `{`; bzip2, xz and zip are named and refused) and from its
//! name where they do not (`.csv`, `.tsv`, before any `.gz` / `.zst`). A row that cannot be read
//! (a JSONL line that is not JSON, a CSV record with the wrong number of fields) is a row error,
//! which the caller reports or skips; a file that cannot be read past some point (a JSON array
//! cut short, a quoted CSV field never closed, a corrupt Parquet file) is an error of the whole
//! read, since no later row can be trusted.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

/// One row of a file: its number (a line for JSONL and CSV, a 1-based row for Parquet and JSON
/// arrays; see [`Rows::numbered`]) and its JSON object, or why it could not be read.
#[derive(Debug)]
pub struct Row {
    pub n: usize,
    pub value: Result<Value, String>,
}

/// The rows of one file, in order. Blank lines (JSONL, CSV) are skipped and counted.
pub struct Rows<'a> {
    name: String,
    numbered: bool,
    blank_lines: usize,
    source: Source<'a>,
}

enum Source<'a> {
    Lines {
        reader: Box<dyn BufRead + 'a>,
        line: usize,
    },
    Array(std::iter::Enumerate<std::vec::IntoIter<Value>>),
    Csv(Csv),
    /// The rows (`None` once the reader has failed) and the rows read so far.
    Parquet(Option<parquet::record::reader::RowIter<'static>>, usize),
}

const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];
const PARQUET_MAGIC: &[u8] = b"PAR1";
/// Arrow IPC: the file format's magic, and the stream format's continuation marker (what
/// `datasets`' `save_to_disk` and its cache write).
const ARROW_FILE_MAGIC: &[u8] = b"ARROW1";
const ARROW_STREAM_MAGIC: &[u8] = &[0xff, 0xff, 0xff, 0xff];

/// How to turn Arrow files into something lorafit reads.
const ARROW_HINT: &str = "Arrow files (what the `datasets` library's save_to_disk and cache \
     write) are not read; write the split as Parquet or JSONL first, e.g. \
     `datasets.load_from_disk(DIR).to_parquet(\"train.parquet\")` for a saved Dataset, \
     `datasets.load_from_disk(DIR)[\"train\"].to_parquet(\"train.parquet\")` for a DatasetDict";

/// The files a dataset setting names: one file, or the files matching a pattern with `*` (any
/// run of characters) or `?` (one character) in its last component (the shards of a split, as
/// `data/train-*.parquet`), in name order. A folder is refused with the dataset files it
/// holds: it may hold several splits, and which ones to read is the user's choice.
pub fn dataset_files(spec: &str) -> Result<Vec<std::path::PathBuf>> {
    let path = Path::new(spec);
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if file_name.contains(['*', '?']) {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if dir.to_str().is_some_and(|d| d.contains(['*', '?'])) {
            bail!("{spec}: a pattern may only match file names, not folders");
        }
        let mut found: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("{spec}: reading the folder {}", dir.display()))?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| wildcard(file_name, n))
            })
            .map(|e| e.path())
            .collect();
        if found.is_empty() {
            bail!("{spec}: no file matches the pattern");
        }
        found.sort();
        return Ok(found);
    }
    if path.is_dir() {
        let entries: Vec<(String, bool)> = std::fs::read_dir(path)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| {
                        let dir = e.file_type().is_ok_and(|t| t.is_dir());
                        e.file_name().to_str().map(|n| (n.to_string(), dir))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let has_arrow = |dir: &Path| {
            std::fs::read_dir(dir).is_ok_and(|mut rd| {
                rd.any(|e| {
                    e.is_ok_and(|e| {
                        e.file_name()
                            .to_str()
                            .is_some_and(|n| n.ends_with(".arrow"))
                    })
                })
            })
        };
        // What `datasets`' save_to_disk writes: a Dataset's .arrow files with dataset_info.json
        // and state.json, or a DatasetDict's dataset_dict.json and a folder of those per split.
        let mut splits: Vec<&str> = entries
            .iter()
            .filter(|(n, dir)| *dir && has_arrow(&path.join(n)))
            .map(|(n, _)| n.as_str())
            .collect();
        splits.sort();
        let saved = has_arrow(path)
            || !splits.is_empty()
            || entries.iter().any(|(n, _)| n == "dataset_dict.json");
        let metadata = ["dataset_info.json", "state.json", "dataset_dict.json"];
        let mut inside: Vec<&str> = entries
            .iter()
            .filter(|(n, dir)| !dir && is_dataset_name(n))
            .filter(|(n, _)| !(saved && metadata.contains(&n.as_str())))
            .map(|(n, _)| n.as_str())
            .collect();
        inside.sort();
        let hint = if saved && inside.is_empty() {
            if splits.is_empty() {
                format!("it holds .arrow files: {ARROW_HINT}")
            } else {
                format!(
                    "it holds a DatasetDict saved by `datasets` (splits {}, as .arrow files): \
                     {ARROW_HINT}",
                    splits.join(", ")
                )
            }
        } else if inside.is_empty() {
            "it holds no dataset file (.jsonl, .json, .csv, .tsv, .parquet, compressed .gz / .zst)"
                .to_string()
        } else {
            let shown: Vec<&str> = inside.iter().take(8).copied().collect();
            let more = inside.len().saturating_sub(8);
            format!(
                "it holds {}{}",
                shown.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )
        };
        bail!(
            "{spec} is a folder: name a file in it, or a pattern for the shards of one split \
             (as {spec}/train-*.parquet); {hint}"
        );
    }
    if !path.exists() {
        let cache = crate::hub_cache::root();
        if let Some(hint) = crate::hub_cache::dataset_hint(spec, cache.as_deref()) {
            bail!("{spec}: no such file. {hint}");
        }
    }
    Ok(vec![path.to_path_buf()])
}

/// Whether a file name ends like a dataset file lorafit reads.
pub(crate) fn is_dataset_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [".jsonl", ".json", ".csv", ".tsv", ".parquet", ".gz", ".zst"]
        .iter()
        .any(|ext| n.ends_with(ext))
}

/// Whether `name` matches `pattern`, where `*` is any run of characters and `?` one character.
fn wildcard(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // The classic two-pointer match with backtracking to the last `*`.
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// Where row `n` of a file sits, the way messages name it: `file:N` (a line) or `file: row N`.
pub fn row_location(name: &str, numbered: bool, n: usize) -> String {
    if numbered {
        format!("{name}: row {n}")
    } else {
        format!("{name}:{n}")
    }
}

impl<'a> Rows<'a> {
    /// The rows of a JSONL stream; `name` is used in messages.
    pub fn jsonl(reader: impl BufRead + 'a, name: &str) -> Rows<'a> {
        Rows {
            name: name.to_string(),
            numbered: false,
            blank_lines: 0,
            source: Source::Lines {
                reader: Box::new(reader),
                line: 0,
            },
        }
    }

    /// Whether rows are numbered as rows (`file: row N`) rather than as lines.
    pub fn numbered(&self) -> bool {
        self.numbered
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Blank lines skipped so far.
    pub fn blank_lines(&self) -> usize {
        self.blank_lines
    }

    /// Where row `n` of this file sits, for messages.
    pub fn location(&self, n: usize) -> String {
        row_location(&self.name, self.numbered, n)
    }
}

impl Rows<'static> {
    /// Opens a dataset file, telling its format from its first bytes and its name. Every
    /// error names the file.
    pub fn open(path: &Path) -> Result<Rows<'static>> {
        let name = path.display().to_string();
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) => {
                if let (Ok(target), false) = (std::fs::read_link(path), path.exists()) {
                    bail!(
                        "{name}: a symbolic link to {}, which does not exist",
                        target.display()
                    );
                }
                return Err(e).with_context(|| format!("opening dataset {name}"));
            }
        };
        let mut reader = BufReader::new(file);
        let head = reader
            .fill_buf()
            .with_context(|| format!("reading {name}"))?
            .to_vec();
        let lower = name.to_ascii_lowercase();
        if let Some(kind) = other_compression(&head) {
            bail!(
                "{name}: {kind}: lorafit reads gzip and zstd; decompress it first (or write it \
                 with gzip or zstd)"
            );
        }
        let (reader, inner_name): (Box<dyn BufRead>, &str) = if head.starts_with(GZIP_MAGIC) {
            let decoder = flate2::bufread::MultiGzDecoder::new(reader);
            let inner = lower.strip_suffix(".gz").unwrap_or(&lower);
            (Box::new(BufReader::new(decoder)), inner)
        } else if head.starts_with(ZSTD_MAGIC) {
            let decoder = zstd::stream::read::Decoder::with_buffer(reader)
                .with_context(|| format!("{name}: starting the zstd decoder"))?;
            let inner = lower
                .strip_suffix(".zst")
                .or_else(|| lower.strip_suffix(".zstd"))
                .unwrap_or(&lower);
            (Box::new(BufReader::new(decoder)), inner)
        } else if head.starts_with(PARQUET_MAGIC)
            || (lower.ends_with(".parquet") && !looks_like_json_text(&head))
        {
            // The bytes decide; the name only where they do not (a JSONL file named `.parquet`
            // is read as the text it is).
            return Rows::parquet(path, name);
        } else if head.starts_with(ARROW_FILE_MAGIC)
            || head.starts_with(ARROW_STREAM_MAGIC)
            || lower.ends_with(".arrow")
        {
            bail!("{name}: {ARROW_HINT}");
        } else {
            (Box::new(reader), lower.as_str())
        };
        let mut reader = reader;
        let inner_head = reader
            .fill_buf()
            .with_context(|| format!("reading {name}"))?;
        if inner_head.starts_with(PARQUET_MAGIC) {
            bail!(
                "{name}: a compressed Parquet file; Parquet compresses its own pages and is read \
                 from its footer, so decompress it first (for example `gunzip -k` or `zstd -d`)"
            );
        }
        if let Some(encoding) = utf16_or_32(inner_head) {
            bail!(
                "{name}: the file is {encoding} text (it starts with that byte-order mark); \
                 dataset files are read as UTF-8: convert it first (for example \
                 `iconv -f {encoding} -t UTF-8 FILE > out`)"
            );
        }
        if let Some(encoding) = wide_text_without_bom(inner_head) {
            bail!(
                "{name}: the file looks like {encoding} text without a byte-order mark (a zero \
                 byte beside each character); dataset files are read as UTF-8: convert it first \
                 (for example `iconv -f {encoding} -t UTF-8 FILE > out`)"
            );
        }
        if let Some(kind) = other_compression(inner_head) {
            bail!("{name}: {kind} inside; lorafit reads gzip and zstd: decompress it first");
        }
        // JSON text named `.csv` is read as the JSON it is.
        let delimiter = if looks_like_json_text(inner_head) {
            None
        } else if inner_name.ends_with(".csv") {
            Some(b',')
        } else if inner_name.ends_with(".tsv") {
            Some(b'\t')
        } else {
            None
        };
        let is_json = inner_name.ends_with(".json");
        Rows::from_text(reader, name, delimiter, is_json)
    }

    fn parquet(path: &Path, name: String) -> Result<Rows<'static>> {
        use parquet::file::reader::SerializedFileReader;
        let file = File::open(path).with_context(|| format!("opening dataset {name}"))?;
        let rows = catch_panic(|| {
            SerializedFileReader::new(file)
                .map(|r| parquet::record::reader::RowIter::from_file_into(Box::new(r)))
        })
        .map_err(|e| format!("the Parquet reader failed: {e}"))
        .and_then(|r| r.map_err(|e| e.to_string()))
        .map_err(|e| anyhow::anyhow!("{name}: not a readable Parquet file ({e})"))?;
        Ok(Rows {
            name,
            numbered: true,
            blank_lines: 0,
            source: Source::Parquet(Some(rows), 0),
        })
    }

    /// A text file (maybe decompressed): CSV / TSV by name, a JSON array by its first character,
    /// JSONL otherwise.
    fn from_text(
        mut reader: Box<dyn BufRead>,
        name: String,
        delimiter: Option<u8>,
        is_json: bool,
    ) -> Result<Rows<'static>> {
        if let Some(delimiter) = delimiter {
            let text = read_text(&mut reader, &name)?;
            let csv = Csv::new(text, delimiter, &name)?;
            return Ok(Rows {
                name,
                numbered: false,
                blank_lines: 0,
                source: Source::Csv(csv),
            });
        }
        if old_mac_text(
            reader
                .fill_buf()
                .with_context(|| format!("reading {name}"))?,
        ) {
            // Lines that end at a lone `\r`: read as the lines they are.
            let text = read_text(&mut reader, &name)?.replace('\r', "\n");
            reader = Box::new(std::io::Cursor::new(text.into_bytes()));
        }
        let head = reader
            .fill_buf()
            .with_context(|| format!("reading {name}"))?;
        let first = first_significant_byte(head);
        // A line that is `{` alone opens no JSONL row: an object over several lines follows.
        let open_brace_line = head.contains(&b'\n') && first_line(head).trim() == "{";
        if first == Some(b'[') || (first == Some(b'{') && (is_json || open_brace_line)) {
            let text = read_text(&mut reader, &name)?;
            let body = text.trim_start_matches('\u{feff}');
            if first == Some(b'{') {
                match serde_json::from_str::<Value>(body) {
                    // A `.json` file of one object per line is JSONL; one object over several
                    // lines is not a list of rows (often rows under a key, as `load_dataset`'s
                    // `field`), nor is one line that holds lists and no field of a row.
                    Ok(Value::Object(obj)) => {
                        let one_line = body.trim().lines().count() <= 1;
                        let rows_under_a_key = obj.values().any(Value::is_array)
                            && !obj.keys().any(|k| READ_FIELDS.contains(&k.as_str()));
                        if let Some(hint) = columns_hint(&obj) {
                            bail!("{name}: {hint}");
                        }
                        if !one_line || rows_under_a_key {
                            bail!("{name}: {}", object_file_hint(&obj, one_line));
                        }
                    }
                    Ok(_) => {}
                    Err(_) => {
                        if let Some(objects) = objects_over_lines(body) {
                            bail!(
                                "{name}: {objects} JSON objects one after another, each over \
                                 several lines (as `jq .` prints them); a dataset file holds one \
                                 row per line (JSONL): write them with `jq -c . {name} > \
                                 rows.jsonl`"
                            );
                        }
                    }
                }
                let reader: Box<dyn BufRead> = Box::new(std::io::Cursor::new(text.into_bytes()));
                return Ok(Rows::jsonl(reader, &name));
            }
            let items: Vec<Value> = serde_json::from_str(body).map_err(|e| {
                anyhow::anyhow!(
                    "{name}:{}:{}: the file starts a JSON array of rows, which does not parse \
                     as JSON here ({e}); no row is read",
                    e.line(),
                    e.column()
                )
            })?;
            return Ok(Rows {
                name,
                numbered: true,
                blank_lines: 0,
                source: Source::Array(items.into_iter().enumerate()),
            });
        }
        Ok(Rows::jsonl(reader, &name))
    }
}

/// Whether text ends its lines with a lone `\r` (old Mac text): its head has a `\r` before its
/// last byte and no `\n`. (A raw `\r` inside a JSON string is not JSON, so in JSONL it can only
/// end a line or be blank space.)
fn old_mac_text(head: &[u8]) -> bool {
    head.len() > 1 && head[..head.len() - 1].contains(&b'\r') && !head.contains(&b'\n')
}

/// The first line of `head` that is not blank, as far as `head` holds it (a byte-order mark
/// dropped).
fn first_line(head: &[u8]) -> String {
    let text = String::from_utf8_lossy(head);
    text.trim_start_matches('\u{feff}')
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .to_string()
}

/// How many JSON objects `body` holds one after another, where there are two or more and they
/// span more lines than there are objects (pretty-printed, as `jq .` writes them); `None` where
/// it holds anything else.
fn objects_over_lines(body: &str) -> Option<usize> {
    let mut count = 0;
    for value in serde_json::Deserializer::from_str(body).into_iter::<Value>() {
        if !value.ok()?.is_object() {
            return None;
        }
        count += 1;
    }
    let lines = body.lines().filter(|l| !l.trim().is_empty()).count();
    (count >= 2 && lines > count).then_some(count)
}

/// What to say of a JSON object of columns, each an object from row index to value (what pandas'
/// `DataFrame.to_json()` writes by default); `None` for any other object.
fn columns_hint(obj: &Map<String, Value>) -> Option<String> {
    let is_column = |v: &Value| {
        v.as_object()
            .is_some_and(|c| !c.is_empty() && c.keys().all(|k| k.parse::<u64>().is_ok()))
    };
    if obj.is_empty() || !obj.values().all(is_column) {
        return None;
    }
    let names: Vec<&str> = obj.keys().map(String::as_str).collect();
    Some(format!(
        "one JSON object of columns ({}), each from row index to value, as pandas' \
         `DataFrame.to_json()` writes by default; a dataset file holds one row per line: write \
         it with `df.to_json(\"rows.jsonl\", orient=\"records\", lines=True)`",
        names.join(", ")
    ))
}

/// What to say of a `.json` file that is one object: over several lines, or on one line holding
/// lists and no field of a row.
fn object_file_hint(obj: &Map<String, Value>, one_line: bool) -> String {
    let lists: Vec<String> = obj
        .iter()
        .filter_map(|(k, v)| v.as_array().map(|a| format!("\"{k}\" ({} items)", a.len())))
        .collect();
    let mut msg = format!(
        "one JSON object {}; a dataset file holds one row per line (JSONL) or one JSON array of \
         rows",
        if one_line {
            "that holds lists and no field of a row"
        } else {
            "over several lines"
        }
    );
    if !lists.is_empty() {
        msg.push_str(&format!(
            ". Its lists: {}; to train on one, write its items one per line (for example \
             `jq -c '.KEY[]' FILE > rows.jsonl`)",
            lists.join(", ")
        ));
    }
    msg
}

/// What a file compressed by a tool lorafit does not decompress is, from its magic number.
fn other_compression(head: &[u8]) -> Option<&'static str> {
    // bzip2: `BZh`, the block size, then a block's or the stream end's magic.
    let bzip2 = head.len() >= 10
        && head.starts_with(b"BZh")
        && (b'1'..=b'9').contains(&head[3])
        && (head[4..10] == [0x31, 0x41, 0x59, 0x26, 0x53, 0x59]
            || head[4..10] == [0x17, 0x72, 0x45, 0x38, 0x50, 0x90]);
    if bzip2 {
        Some("bzip2-compressed")
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        Some("xz-compressed")
    } else if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        Some("a zip archive")
    } else {
        None
    }
}

/// Whether a file's first bytes are those of JSON text (after a UTF-8 byte-order mark and
/// whitespace, an object or an array opens).
fn looks_like_json_text(head: &[u8]) -> bool {
    let body = head.strip_prefix(&[0xef, 0xbb, 0xbf][..]).unwrap_or(head);
    matches!(
        body.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{') | Some(b'[')
    )
}

/// The encoding a UTF-16 or UTF-32 byte-order mark names, if the text starts with one
/// (what Windows tools write as "Unicode").
fn utf16_or_32(head: &[u8]) -> Option<&'static str> {
    if head.starts_with(&[0xff, 0xfe, 0, 0]) {
        Some("UTF-32LE")
    } else if head.starts_with(&[0, 0, 0xfe, 0xff]) {
        Some("UTF-32BE")
    } else if head.starts_with(&[0xff, 0xfe]) {
        Some("UTF-16LE")
    } else if head.starts_with(&[0xfe, 0xff]) {
        Some("UTF-16BE")
    } else {
        None
    }
}

/// The encoding of text written two or four bytes a character with no byte-order mark, judged
/// from its first bytes: in such text of Latin letters, digits and JSON or CSV punctuation,
/// every character has zero bytes at the same places, which UTF-8 text never has (a NUL is not
/// text). `None` where the head is too short to tell or has no such pattern.
fn wide_text_without_bom(head: &[u8]) -> Option<&'static str> {
    let head = &head[..head.len().min(256) / 4 * 4];
    if head.len() < 8 {
        return None;
    }
    // Zero bytes counted by their place in each group of four.
    let mut zeros = [0usize; 4];
    for (i, &b) in head.iter().enumerate() {
        if b == 0 {
            zeros[i % 4] += 1;
        }
    }
    let groups = head.len() / 4;
    // Most characters of such a file are one unit wide: 90% of the groups carry the pattern.
    let most = |n: usize| n * 10 >= groups * 9;
    let none = |n: usize| n * 10 <= groups;
    if most(zeros[1]) && most(zeros[2]) && most(zeros[3]) && none(zeros[0]) {
        Some("UTF-32LE")
    } else if most(zeros[0]) && most(zeros[1]) && most(zeros[2]) && none(zeros[3]) {
        Some("UTF-32BE")
    } else if most(zeros[1]) && most(zeros[3]) && none(zeros[0]) && none(zeros[2]) {
        Some("UTF-16LE")
    } else if most(zeros[0]) && most(zeros[2]) && none(zeros[1]) && none(zeros[3]) {
        Some("UTF-16BE")
    } else {
        None
    }
}

/// The first byte of `head` that is neither whitespace nor part of a UTF-8 byte-order mark.
fn first_significant_byte(head: &[u8]) -> Option<u8> {
    head.iter()
        .copied()
        .find(|b| !b.is_ascii_whitespace() && ![0xef, 0xbb, 0xbf].contains(b))
}

/// The whole (decompressed) file as text; invalid UTF-8 is an error naming its line.
fn read_text(reader: &mut Box<dyn BufRead>, name: &str) -> Result<String> {
    let mut bytes = Vec::new();
    reader
        .read_to_end(&mut bytes)
        .with_context(|| format!("{name}: reading"))?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        anyhow::anyhow!("{name}:{line}: not valid UTF-8 text ({})", e.utf8_error())
    })
}

impl Iterator for Rows<'_> {
    type Item = Result<Row>;

    fn next(&mut self) -> Option<Result<Row>> {
        match &mut self.source {
            Source::Lines { reader, line } => loop {
                let mut buf = Vec::new();
                match reader.read_until(b'\n', &mut buf) {
                    Ok(0) => return None,
                    Ok(_) => {}
                    Err(e) => {
                        let n = *line + 1;
                        return Some(Err(anyhow::anyhow!("{}:{n}: reading ({e})", self.name)));
                    }
                }
                *line += 1;
                let n = *line;
                let value = match std::str::from_utf8(&buf) {
                    Ok(text) => {
                        // A byte-order mark opens the file, or a line where files written
                        // with one were joined (`cat a.jsonl b.jsonl`): not part of the row.
                        let text = text.trim_start_matches('\u{feff}');
                        if text.trim().is_empty() {
                            self.blank_lines += 1;
                            continue;
                        }
                        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))
                    }
                    Err(e) => Err(format!("line is not valid UTF-8 ({e})")),
                };
                return Some(Ok(Row { n, value }));
            },
            Source::Array(items) => items.next().map(|(i, value)| {
                Ok(Row {
                    n: i + 1,
                    value: Ok(value),
                })
            }),
            Source::Csv(csv) => {
                let name = &self.name;
                loop {
                    match csv.record(name) {
                        Err(e) => return Some(Err(e)),
                        Ok(None) => return None,
                        Ok(Some(Record::Blank)) => self.blank_lines += 1,
                        Ok(Some(Record::Row(row))) => return Some(Ok(row)),
                    }
                }
            }
            Source::Parquet(iter, n) => {
                let rows = iter.as_mut()?;
                let next = match catch_panic(|| {
                    rows.next()
                        .map(|row| row.map(|row| parquet_row_value(&row)))
                }) {
                    Ok(next) => next?,
                    Err(panic) => {
                        // The reader's state is unknown after a panic: nothing more is read.
                        *iter = None;
                        return Some(Err(anyhow::anyhow!(
                            "{}: not a readable Parquet file (the Parquet reader failed at row \
                             {}: {panic}); no row after it is read",
                            self.name,
                            *n + 1
                        )));
                    }
                };
                *n += 1;
                let n = *n;
                Some(match next {
                    Ok(value) => Ok(Row { n, value }),
                    Err(e) => {
                        let codec = if e.to_string().contains("Disabled feature") {
                            "; Parquet pages compressed with snappy, zstd, gzip or none are read: \
                             write the file with one of them (pyarrow: `compression=\"zstd\"`)"
                        } else {
                            ""
                        };
                        Err(anyhow::anyhow!(
                            "{}: row {n}: reading the row ({e}){codec}",
                            self.name
                        ))
                    }
                })
            }
        }
    }
}

/// The top-level fields some reader of rows reads: the row layouts of `data::dataset`, `weight`,
/// `tools` (refused there), and `curate`'s raw rows and scores. A Parquet value JSON cannot hold
/// (a NaN, bytes that are not UTF-8) is a row error in these and ignored in any other column.
pub(crate) const READ_FIELDS: &[&str] = &[
    "prompt",
    "chosen",
    "rejected",
    "completion",
    "messages",
    "conversations",
    "text",
    "instruction",
    "input",
    "output",
    "system",
    "weight",
    "tools",
    "completions",
    "score_chosen",
    "score_rejected",
];

/// A Parquet row as JSON. JSON has no NaN or infinity, and the Parquet crate writes them as
/// null, which a `weight` column reads as its default: a non-finite number in a column lorafit
/// reads ([`READ_FIELDS`]) is a row error naming the field instead. A `binary` column (bytes
/// without the UTF-8 annotation, which the crate writes as base64) is read as the text its bytes
/// are. A decimal `weight` is read as the number it is.
fn parquet_row_value(row: &parquet::record::Row) -> Result<Value, String> {
    use parquet::record::Field;
    let mut obj = Map::new();
    for (column, field) in row.get_column_iter() {
        let value = if READ_FIELDS.contains(&column.as_str()) {
            let value = parquet_field_value(field, column)?;
            match (field, value) {
                (Field::Decimal(_), Value::String(text)) if column == "weight" => text
                    .parse::<f64>()
                    .ok()
                    .and_then(serde_json::Number::from_f64)
                    .map_or(Value::String(text), Value::Number),
                (_, value) => value,
            }
        } else {
            parquet_field_value(field, column).unwrap_or_else(|_| field.to_json_value())
        };
        obj.insert(column.clone(), value);
    }
    Ok(Value::Object(obj))
}

/// One Parquet value (at `path`, as `messages[1].content`) as JSON: bytes as UTF-8 text, and an
/// error for what JSON cannot hold.
fn parquet_field_value(field: &parquet::record::Field, path: &str) -> Result<Value, String> {
    use parquet::record::Field;
    let float = match field {
        Field::Float16(x) => Some(f64::from(*x)),
        Field::Float(x) => Some(f64::from(*x)),
        Field::Double(x) => Some(*x),
        _ => None,
    };
    if let Some(x) = float.filter(|x| !x.is_finite()) {
        return Err(format!(
            "field \"{path}\": {x}, where a finite number is expected"
        ));
    }
    Ok(match field {
        Field::Bytes(bytes) => match std::str::from_utf8(bytes.data()) {
            Ok(text) => Value::String(text.to_string()),
            Err(e) => {
                return Err(format!(
                    "field \"{path}\": bytes that are not UTF-8 text ({e})"
                ))
            }
        },
        Field::Group(row) => {
            let mut obj = Map::new();
            for (key, f) in row.get_column_iter() {
                obj.insert(
                    key.clone(),
                    parquet_field_value(f, &format!("{path}.{key}"))?,
                );
            }
            Value::Object(obj)
        }
        Field::ListInternal(list) => Value::Array(
            list.elements()
                .iter()
                .enumerate()
                .map(|(i, f)| parquet_field_value(f, &format!("{path}[{i}]")))
                .collect::<Result<_, _>>()?,
        ),
        Field::MapInternal(map) => {
            let mut obj = Map::new();
            for (key, f) in map.entries() {
                let key = match parquet_field_value(key, path)? {
                    Value::String(k) => k,
                    other => other.to_string(),
                };
                let value = parquet_field_value(f, &format!("{path}.{key}"))?;
                obj.insert(key, value);
            }
            Value::Object(obj)
        }
        other => other.to_json_value(),
    })
}

/// Held while [`catch_panic`] has the panic hook swapped, so that each call restores the hook it
/// found.
static HOOK_SWAP: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f`, turning a panic into an error with the panic's message. The `parquet` crate panics
/// on some corrupt files (an index out of range, a missing metadata field) where it should
/// return an error; the panic hook is kept from printing for a panic on this thread while `f`
/// runs, and is the previous one again after.
fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    use std::cell::Cell;
    use std::panic::{self, AssertUnwindSafe, PanicHookInfo};
    use std::sync::Arc;
    type Hook = Box<dyn Fn(&PanicHookInfo<'_>) + Sync + Send + 'static>;
    thread_local! {
        static QUIET: Cell<bool> = const { Cell::new(false) };
    }
    let guard = HOOK_SWAP.lock().unwrap_or_else(|e| e.into_inner());
    let previous: Arc<Hook> = Arc::new(panic::take_hook());
    let outer = Arc::clone(&previous);
    // Other threads' panics still reach the previous hook.
    panic::set_hook(Box::new(move |info| {
        if !QUIET.with(Cell::get) {
            outer(info)
        }
    }));
    QUIET.with(|q| q.set(true));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(false));
    drop(panic::take_hook());
    match Arc::try_unwrap(previous) {
        Ok(hook) => panic::set_hook(hook),
        Err(shared) => panic::set_hook(Box::new(move |info| shared(info))),
    }
    drop(guard);
    result.map_err(|payload| {
        if let Some(s) = payload.downcast_ref::<&str>() {
            s.to_string()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "a panic without a message".to_string()
        }
    })
}

/// A CSV (or TSV) text with a header row, read record by record as Python's `csv` module reads
/// it: fields quoted with `"` may hold the delimiter, newlines and `""` (one quote); text after a
/// closing quote joins the field; quotes inside an unquoted field are kept. Every cell is a
/// string, except in a column named `weight`, where a number becomes a JSON number and an empty
/// cell null (the row's default weight).
struct Csv {
    text: String,
    pos: usize,
    line: usize,
    delimiter: u8,
    header: Vec<String>,
}

enum Record {
    Blank,
    Row(Row),
}

impl Csv {
    fn new(text: String, delimiter: u8, name: &str) -> Result<Csv> {
        let mut csv = Csv {
            pos: if text.starts_with('\u{feff}') { 3 } else { 0 },
            text,
            line: 1,
            delimiter,
            header: Vec::new(),
        };
        let header = loop {
            match csv.fields(name)? {
                None => bail!("{name}: no header row (the first line names the columns)"),
                Some((_, fields)) if fields.len() == 1 && fields[0].is_empty() => continue,
                Some((line, fields)) => break (line, fields),
            }
        };
        let (line, fields) = header;
        let last = fields.len() - 1;
        for (i, f) in fields.iter().enumerate() {
            let f = f.trim();
            // pandas' `to_csv` writes its index as a first column with no name, and a trailing
            // delimiter leaves a last one: named as pandas reads them back, and ignored.
            let f = if f.is_empty() && fields.len() > 1 && (i == 0 || i == last) {
                format!("Unnamed: {i}")
            } else if f.is_empty() {
                bail!("{name}:{line}: header column {} has no name", i + 1);
            } else {
                f.to_string()
            };
            if csv.header.contains(&f) {
                bail!(
                    "{name}:{line}: header names column \"{}\" twice",
                    f.escape_debug()
                );
            }
            csv.header.push(f);
        }
        Ok(csv)
    }

    /// The next record as a row, a blank line, or the end of the text.
    fn record(&mut self, name: &str) -> Result<Option<Record>> {
        let Some((line, fields)) = self.fields(name)? else {
            return Ok(None);
        };
        if fields.len() == 1 && fields[0].is_empty() {
            return Ok(Some(Record::Blank));
        }
        let value = if fields.len() != self.header.len() {
            let columns: Vec<String> = self
                .header
                .iter()
                .map(|h| h.escape_debug().to_string())
                .collect();
            Err(format!(
                "{} fields, where the header has {} columns ({})",
                fields.len(),
                self.header.len(),
                columns.join(", ")
            ))
        } else {
            let mut obj = Map::new();
            let mut bad = None;
            for (column, cell) in self.header.iter().zip(fields) {
                match cell_value(column, cell) {
                    Ok(v) => {
                        obj.insert(column.clone(), v);
                    }
                    Err(e) => bad = bad.or(Some(e)),
                }
            }
            match bad {
                Some(e) => Err(e),
                None => Ok(Value::Object(obj)),
            }
        };
        Ok(Some(Record::Row(Row { n: line, value })))
    }

    /// The fields of the next record and the line it starts on; `None` at the end of the text.
    fn fields(&mut self, name: &str) -> Result<Option<(usize, Vec<String>)>> {
        let bytes = self.text.as_bytes();
        if self.pos >= bytes.len() {
            return Ok(None);
        }
        let start_line = self.line;
        let mut fields = Vec::new();
        let mut field: Vec<u8> = Vec::new();
        let mut i = self.pos;
        loop {
            // At the start of a field.
            if i < bytes.len() && bytes[i] == b'"' {
                i += 1;
                loop {
                    match bytes.get(i) {
                        None => bail!(
                            "{name}:{start_line}: a quoted field opened in the record that starts \
                             on this line is never closed; no row after it is read"
                        ),
                        Some(b'"') if bytes.get(i + 1) == Some(&b'"') => {
                            field.push(b'"');
                            i += 2;
                        }
                        Some(b'"') => {
                            i += 1;
                            break;
                        }
                        Some(&b) => {
                            // A line ends at `\n`, or at a `\r` alone (old Mac text).
                            if b == b'\n' || (b == b'\r' && bytes.get(i + 1) != Some(&b'\n')) {
                                self.line += 1;
                            }
                            field.push(b);
                            i += 1;
                        }
                    }
                }
            }
            // Unquoted text, or text after a closing quote, up to the delimiter or the line's end.
            while i < bytes.len()
                && bytes[i] != self.delimiter
                && bytes[i] != b'\n'
                && bytes[i] != b'\r'
            {
                field.push(bytes[i]);
                i += 1;
            }
            if i < bytes.len() && bytes[i] == self.delimiter {
                fields.push(take_field(&mut field));
                i += 1;
                continue;
            }
            // The record ends at `\n`, `\r\n` or a lone `\r` (as Python's `csv` reads old Mac
            // text), or at the end of the text.
            fields.push(take_field(&mut field));
            if i < bytes.len() {
                if bytes[i] == b'\r' && bytes.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                i += 1;
                self.line += 1;
            }
            self.pos = i;
            return Ok(Some((start_line, fields)));
        }
    }
}

/// The field's text (the input is UTF-8 and fields split at ASCII bytes, so it stays UTF-8).
fn take_field(field: &mut Vec<u8>) -> String {
    String::from_utf8(std::mem::take(field)).expect("fields split UTF-8 text at ASCII bytes")
}

/// A CSV cell as JSON: a string, except in a `weight` column (a number, null where empty, an
/// error where the number is not finite).
fn cell_value(column: &str, cell: String) -> Result<Value, String> {
    if column == "weight" {
        if cell.trim().is_empty() {
            return Ok(Value::Null);
        }
        if let Ok(x) = cell.trim().parse::<f64>() {
            return serde_json::Number::from_f64(x)
                .map(Value::Number)
                .ok_or_else(|| {
                    format!("field \"weight\": {x}, where a finite number is expected")
                });
        }
    }
    Ok(Value::String(cell))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    type Read = Vec<(usize, Result<Value, String>)>;

    #[test]
    fn wide_text_is_told_from_utf8_by_its_zero_bytes() {
        let text =
            r#"{"prompt":"Wie heißt 東京 auf Deutsch? 🙂","chosen":"Tokio","rejected":"Kyoto"}"#;
        assert_eq!(wide_text_without_bom(text.as_bytes()), None);
        let le: Vec<u8> = text.encode_utf16().flat_map(|u| u.to_le_bytes()).collect();
        let be: Vec<u8> = text.encode_utf16().flat_map(|u| u.to_be_bytes()).collect();
        assert_eq!(wide_text_without_bom(&le), Some("UTF-16LE"));
        assert_eq!(wide_text_without_bom(&be), Some("UTF-16BE"));
        let be32: Vec<u8> = text
            .chars()
            .flat_map(|c| (c as u32).to_be_bytes())
            .collect();
        assert_eq!(wide_text_without_bom(&be32), Some("UTF-32BE"));
        // Too short to judge: a few bytes are read as whatever they are.
        assert_eq!(wide_text_without_bom(&le[..6]), None);
    }

    /// A panic in `f` is an error with its message, not printed; the hook found before is the
    /// hook after, and a value is passed through.
    #[test]
    fn catch_panic_turns_a_panic_into_its_message() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let ran = Arc::new(AtomicBool::new(false));
        let here = std::thread::current().id();
        let previous = {
            let _swap = HOOK_SWAP.lock().unwrap_or_else(|e| e.into_inner());
            let previous = std::panic::take_hook();
            let ran = Arc::clone(&ran);
            std::panic::set_hook(Box::new(move |_| {
                if std::thread::current().id() == here {
                    ran.store(true, Ordering::SeqCst);
                }
            }));
            previous
        };
        let index = 3;
        assert_eq!(
            catch_panic(|| -> u8 { panic!("index {index} out of range") }),
            Err("index 3 out of range".to_string())
        );
        assert_eq!(
            catch_panic(|| -> u8 { panic!("static") }),
            Err("static".into())
        );
        assert_eq!(catch_panic(|| 7), Ok(7));
        assert!(!ran.load(Ordering::SeqCst));
        let _swap = HOOK_SWAP.lock().unwrap_or_else(|e| e.into_inner());
        assert!(std::panic::catch_unwind(|| panic!("after")).is_err());
        drop(std::panic::take_hook());
        std::panic::set_hook(previous);
        assert!(ran.load(Ordering::SeqCst));
    }

    /// Every row of a file, whether rows are numbered, and the blank lines skipped.
    fn all(path: &Path) -> (Read, bool, usize) {
        let mut rows = Rows::open(path).unwrap();
        let got = rows
            .by_ref()
            .map(|r| r.map(|r| (r.n, r.value)).unwrap())
            .collect();
        (got, rows.numbered(), rows.blank_lines())
    }

    fn tmp(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("lorafit-rows-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// JSONL files written with a byte-order mark and joined (`cat a.jsonl b.jsonl`): the
    /// second file's mark opens a line in the middle, and is read as a mark there too.
    #[test]
    fn joined_jsonl_files_with_byte_order_marks() {
        let d = tmp("bom");
        let row = r#"{"prompt":"p","chosen":"a","rejected":"b"}"#;
        let p = write(
            &d,
            "joined.jsonl",
            format!("\u{feff}{row}\n\u{feff}{row}\n").as_bytes(),
        );
        let (got, _, _) = all(&p);
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|(_, v)| v.is_ok()), "{got:?}");
    }

    #[test]
    fn csv_quoting_as_python_reads_it() {
        let d = tmp("csv");
        let text = "\u{feff}prompt,chosen,rejected,weight\r\n\
                    \"Say \"\"hi\"\", twice\",\"hi\nhi\",no,0.5\r\n\
                    \r\n\
                    plain,a\"b,\"c\"d,\n\
                    short,row\n\
                    last,x,y,2";
        let p = write(&d, "t.csv", text.as_bytes());
        let (rows, numbered, blank) = all(&p);
        assert!(!numbered);
        assert_eq!(blank, 1);
        assert_eq!(rows.len(), 4);
        assert_eq!(
            rows[0],
            (
                2,
                Ok(json!({"prompt": "Say \"hi\", twice", "chosen": "hi\nhi",
                          "rejected": "no", "weight": 0.5}))
            )
        );
        // A record's number is the line it starts on (the quoted newline moved the next one).
        assert_eq!(
            rows[1],
            (
                5,
                Ok(
                    json!({"prompt": "plain", "chosen": "a\"b", "rejected": "cd",
                          "weight": null})
                )
            )
        );
        let (n, e) = &rows[2];
        assert_eq!(*n, 6);
        assert_eq!(
            e.as_ref().unwrap_err(),
            "2 fields, where the header has 4 columns (prompt, chosen, rejected, weight)"
        );
        assert_eq!(rows[3].0, 7);
        assert_eq!(rows[3].1.as_ref().unwrap()["weight"], json!(2.0));
    }

    #[test]
    fn csv_with_old_mac_line_ends() {
        let d = tmp("csv-cr");
        let p = write(
            &d,
            "cr.csv",
            b"prompt,chosen,rejected\ra,b,c\r\"two\rlines\",e,f\rg,h,i\r",
        );
        let (rows, _, blank) = all(&p);
        assert_eq!(blank, 0);
        let got: Vec<(usize, Value)> = rows.into_iter().map(|(n, v)| (n, v.unwrap())).collect();
        assert_eq!(
            got,
            vec![
                (2, json!({"prompt": "a", "chosen": "b", "rejected": "c"})),
                (
                    3,
                    json!({"prompt": "two\rlines", "chosen": "e", "rejected": "f"})
                ),
                (5, json!({"prompt": "g", "chosen": "h", "rejected": "i"})),
            ]
        );
    }

    /// The bytes decide a file's format where they can: JSONL named `.parquet` is read as JSONL;
    /// a decimal Parquet weight is the number it is.
    #[test]
    fn content_over_name_and_decimal_weights() {
        let d = tmp("named");
        let p = write(
            &d,
            "rows.parquet",
            b"{\"prompt\":\"q\",\"chosen\":\"a\",\"rejected\":\"b\"}\n",
        );
        let (rows, numbered, _) = all(&p);
        assert!(!numbered);
        assert_eq!(rows[0].1.as_ref().unwrap()["chosen"], json!("a"));
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data");
        let (rows, _, _) = all(&fixture.join("decimal_weight.parquet"));
        assert_eq!(rows[0].1.as_ref().unwrap()["weight"], json!(2.5));
    }

    #[test]
    fn tsv_and_broken_csv() {
        let d = tmp("tsv");
        let p = write(&d, "t.tsv", b"prompt\tchosen\trejected\nq\ta, b\tc\n");
        let (rows, _, _) = all(&p);
        assert_eq!(
            rows,
            vec![(
                2,
                Ok(json!({"prompt": "q", "chosen": "a, b", "rejected": "c"}))
            )]
        );
        let p = write(
            &d,
            "open.csv",
            b"prompt,chosen,rejected\nq,\"never closed\n,x\n",
        );
        let mut rows = Rows::open(&p).unwrap();
        let e = rows.next().unwrap().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{}:2: a quoted field", p.display())),
            "{e}"
        );
        let p = write(&d, "dup.csv", b"prompt,chosen,prompt\n");
        let e = Rows::open(&p).err().unwrap().to_string();
        assert!(
            e.ends_with(":1: header names column \"prompt\" twice"),
            "{e}"
        );
        let p = write(&d, "noname.csv", b"prompt,,rejected\n");
        let e = Rows::open(&p).err().unwrap().to_string();
        assert!(e.ends_with(":1: header column 2 has no name"), "{e}");
        let p = write(&d, "empty.csv", b"\n\n");
        let e = Rows::open(&p).err().unwrap().to_string();
        assert!(e.contains("no header row"), "{e}");
    }

    #[test]
    fn patterns_name_shards_and_folders_are_refused() {
        assert!(wildcard("train-*.parquet", "train-00001-of-00002.parquet"));
        assert!(wildcard("t?ain*", "train"));
        assert!(wildcard("*a*b", "xxaxxb"));
        assert!(!wildcard("*a*b", "xxaxxbx"));
        assert!(!wildcard("train-*.parquet", "test-00000-of-00001.parquet"));
        let d = tmp("glob");
        for n in ["train-1.jsonl", "train-0.jsonl", "test-0.jsonl"] {
            write(&d, n, b"{}\n");
        }
        std::fs::create_dir_all(d.join("train-dir.jsonl")).unwrap();
        let spec = format!("{}/train-*.jsonl", d.display());
        let names: Vec<String> = dataset_files(&spec)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["train-0.jsonl", "train-1.jsonl"]);
        let e = dataset_files(&format!("{}/valid-*.jsonl", d.display())).unwrap_err();
        assert!(
            e.to_string().ends_with("no file matches the pattern"),
            "{e}"
        );
        let e = dataset_files(&d.display().to_string())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is a folder")
                && e.contains("it holds test-0.jsonl, train-0.jsonl, train-1.jsonl"),
            "{e}"
        );
        let saved = d.join("saved");
        std::fs::create_dir_all(&saved).unwrap();
        write(
            &saved,
            "data-00000-of-00001.arrow",
            &[0xff, 0xff, 0xff, 0xff, 8, 0, 0, 0],
        );
        let e = dataset_files(&saved.display().to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("it holds .arrow files: Arrow files"), "{e}");
        let arrow = saved.join("data-00000-of-00001.arrow");
        let e = Rows::open(&arrow).err().unwrap().to_string();
        assert!(e.contains("to_parquet"), "{e}");
        let one = d.join("test-0.jsonl");
        assert_eq!(dataset_files(&one.display().to_string()).unwrap(), [one]);
    }

    #[test]
    fn json_arrays_objects_and_compression() {
        let d = tmp("json");
        let rows = json!([{"prompt": "a", "chosen": "b", "rejected": "c"}, 7]);
        // A minified array: rows are numbered, not lined.
        let p = write(&d, "a.json", rows.to_string().as_bytes());
        let (got, numbered, _) = all(&p);
        assert!(numbered);
        assert_eq!(got, vec![(1, Ok(rows[0].clone())), (2, Ok(json!(7)))]);
        // The same array pretty-printed, under any name, reads the same.
        let pretty = serde_json::to_string_pretty(&rows).unwrap();
        let p = write(&d, "a.jsonl", pretty.as_bytes());
        assert_eq!(all(&p).0, got);
        // A broken array is an error of the whole file, with its line and column.
        let p = write(&d, "cut.json", b"[\n{\"prompt\": \"a\"},\n{\"prompt\": \n");
        let e = Rows::open(&p).err().unwrap().to_string();
        assert!(
            e.starts_with(&format!("{}:4:0: the file starts", p.display())),
            "{e}"
        );
        // One object over several lines: named as such, with its lists.
        let p = write(
            &d,
            "o.json",
            b"{\n\"data\": [{\"prompt\": \"a\"}],\n\"v\": 1\n}\n",
        );
        let e = Rows::open(&p).err().unwrap().to_string();
        assert!(e.contains("Its lists: \"data\" (1 items)"), "{e}");
        // A one-line object in a .json file is a JSONL file of one row.
        let p = write(&d, "one.json", b"{\"prompt\": \"a\"}\n");
        assert_eq!(all(&p).0, vec![(1, Ok(json!({"prompt": "a"})))]);
        // gzip and zstd, the format from the name under the suffix or from the content.
        let jsonl = b"{\"x\": 1}\n\n{\"x\": 2}\n";
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, jsonl).unwrap();
        let p = write(&d, "r.jsonl.gz", &gz.finish().unwrap());
        let (got, numbered, blank) = all(&p);
        assert_eq!(
            (got, numbered, blank),
            (
                vec![(1, Ok(json!({"x": 1}))), (3, Ok(json!({"x": 2})))],
                false,
                1
            )
        );
        let csv = zstd::stream::encode_all(&b"x,y\n1,2\n"[..], 1).unwrap();
        let p = write(&d, "r.csv.zst", &csv);
        assert_eq!(all(&p).0, vec![(2, Ok(json!({"x": "1", "y": "2"})))]);
        // Text that is not UTF-8 names its line.
        let p = write(&d, "bad.csv", b"x\n\xff\n");
        let e = Rows::open(&p).err().unwrap().to_string();
        assert!(e.contains("bad.csv:2: not valid UTF-8"), "{e}");
    }
}
