//! A judge-free verifiable-instruction scorer in the manner of IFEval (Zhou et al., 2023,
//! "Instruction-Following Evaluation for Large Language Models"): each prompt carries
//! instructions whose compliance a program can decide ("answer in fewer than 50 words", "no
//! commas", "wrap the answer in JSON"), and a response is scored per instruction and per prompt.
//!
//! The instruction ids and their argument names are IFEval's, so a prompt file in IFEval's
//! format (`{"key", "prompt", "instruction_id_list", "kwargs"}`) loads as is. One id is ours:
//! `startend:start_checker` (the response begins with a phrase; IFEval's own
//! `multi-turn:constrained_start` is disabled in its registry).
//!
//! Strict accuracy checks the response as generated. Loose accuracy, as IFEval defines it, counts
//! an instruction as followed when any of eight variants passes: the response, the response with
//! its first line removed, with its last line removed, with both removed, and each of those four
//! with every `*` deleted (markdown emphasis). A variant that is empty after trimming never
//! passes. Prompt-level accuracy asks for all of a prompt's instructions at once;
//! instruction-level accuracy counts instructions.
//!
//! The counting rules follow IFEval's checkers where they are exact (placeholders, bullets,
//! highlights, sections, paragraphs, postscripts, JSON, titles, end phrases, quotation). Three
//! differ because IFEval calls libraries we do not ship: sentences are split by a rule-based
//! splitter ([`count_sentences`]) instead of NLTK's Punkt, capital words are counted over
//! whitespace/punctuation-separated tokens instead of NLTK's word tokenizer, and the language is
//! told by [`super::language`] instead of `langdetect`.

use super::language::{self, Detected};
use serde_json::{Map, Value};

/// Every instruction id this scorer knows, in IFEval's registry order (ours last).
pub const INSTRUCTION_IDS: &[&str] = &[
    "keywords:existence",
    "keywords:frequency",
    "keywords:forbidden_words",
    "keywords:letter_frequency",
    "language:response_language",
    "length_constraints:number_sentences",
    "length_constraints:number_paragraphs",
    "length_constraints:number_words",
    "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders",
    "detectable_content:postscript",
    "detectable_format:number_bullet_lists",
    "detectable_format:constrained_response",
    "detectable_format:number_highlighted_sections",
    "detectable_format:multiple_sections",
    "detectable_format:json_format",
    "detectable_format:title",
    "combination:two_responses",
    "combination:repeat_prompt",
    "startend:end_checker",
    "change_case:capital_word_frequency",
    "change_case:english_capital",
    "change_case:english_lowercase",
    "punctuation:no_comma",
    "startend:quotation",
    "startend:start_checker",
];

/// IFEval's `constrained_response` options.
pub const CONSTRAINED_RESPONSES: [&str; 3] = [
    "My answer is yes.",
    "My answer is no.",
    "My answer is maybe.",
];

/// IFEval's comparison of a count with a threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    /// `count < threshold`.
    LessThan,
    /// `count >= threshold`.
    AtLeast,
}

impl Relation {
    pub fn parse(s: &str) -> Option<Relation> {
        match s {
            "less than" => Some(Relation::LessThan),
            "at least" => Some(Relation::AtLeast),
            _ => None,
        }
    }
    pub fn holds(self, count: usize, threshold: usize) -> bool {
        match self {
            Relation::LessThan => count < threshold,
            Relation::AtLeast => count >= threshold,
        }
    }
}

/// One verifiable instruction with its arguments.
#[derive(Debug, Clone, PartialEq)]
pub enum Check {
    /// Every keyword appears (case-insensitive substring).
    KeywordsIncluded(Vec<String>),
    /// `keyword` appears (case-insensitive, non-overlapping) `relation` `frequency` times.
    KeywordFrequency {
        keyword: String,
        frequency: usize,
        relation: Relation,
    },
    /// None of the words appears as a whole word (case-insensitive).
    KeywordsExcluded(Vec<String>),
    /// The letter (case-insensitive) appears `relation` `frequency` times.
    LetterFrequency {
        letter: char,
        frequency: usize,
        relation: Relation,
    },
    /// The response is in this language (ISO 639-1), as [`language::detect`] tells.
    ResponseLanguage(String),
    Sentences {
        count: usize,
        relation: Relation,
    },
    /// Exactly `count` paragraphs separated by the markdown divider `***`.
    ParagraphsDivided(usize),
    Words {
        count: usize,
        relation: Relation,
    },
    /// Exactly `paragraphs` paragraphs separated by blank lines (`\n\n`), paragraph `nth`
    /// (1-based) starting with `first_word` (case-insensitive, punctuation after it ignored).
    NthParagraphFirstWord {
        paragraphs: usize,
        nth: usize,
        first_word: String,
    },
    /// At least this many `[placeholder]`s.
    Placeholders(usize),
    /// A postscript starting with the marker (`P.S.`, `P.P.S` or another phrase).
    Postscript(String),
    /// Exactly this many markdown bullets (`* item` or `- item` lines).
    BulletList(usize),
    /// The response contains one of [`CONSTRAINED_RESPONSES`].
    ConstrainedResponse,
    /// At least this many `*highlighted*` (or `**highlighted**`) sections.
    HighlightedSections(usize),
    /// At least `count` sections, each marked `{splitter} N`.
    Sections {
        splitter: String,
        count: usize,
    },
    /// The whole response is JSON (a markdown code fence around it is allowed).
    Json,
    /// A title in double angular brackets, `<<title>>`.
    Title,
    /// Two different responses separated by `******`.
    TwoResponses,
    /// The response begins by repeating this request word for word (case-insensitive).
    RepeatPrompt(String),
    /// The response begins with this phrase (case-insensitive; a leading `"` is ignored).
    StartPhrase(String),
    /// The response ends with this phrase (case-insensitive; a trailing `"` is ignored).
    EndPhrase(String),
    /// Words in all capital letters appear `relation` `frequency` times.
    CapitalWordFrequency {
        frequency: usize,
        relation: Relation,
    },
    /// English, in capital letters only.
    AllCapitals,
    /// English, in lowercase letters only.
    AllLowercase,
    NoComma,
    /// Wrapped in double quotation marks.
    Quotation,
}

/// An instruction as a prompt file names it: the id (one of [`INSTRUCTION_IDS`]) and its check.
#[derive(Debug, Clone, PartialEq)]
pub struct Instruction {
    pub id: String,
    pub check: Check,
}

/// Reads an instruction's arguments, naming the argument at fault. Null arguments count as
/// absent (IFEval's files list every argument name with null for the unused ones).
struct Args<'a> {
    map: &'a Map<String, Value>,
    used: Vec<&'static str>,
}

impl<'a> Args<'a> {
    fn get(&mut self, name: &'static str) -> Option<&'a Value> {
        self.used.push(name);
        self.map.get(name).filter(|v| !v.is_null())
    }
    fn string(&mut self, name: &'static str) -> Result<String, String> {
        match self.get(name) {
            Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.trim().to_string()),
            Some(Value::String(_)) => Err(format!("{name}: empty string")),
            Some(v) => Err(format!("{name}: expected a string, found {v}")),
            None => Err(format!("{name}: missing")),
        }
    }
    fn count(&mut self, name: &'static str, min: usize) -> Result<usize, String> {
        match self.get(name) {
            Some(v) => match v.as_u64() {
                Some(n) if n as usize >= min => Ok(n as usize),
                _ => Err(format!("{name}: expected an integer >= {min}, found {v}")),
            },
            None => Err(format!("{name}: missing")),
        }
    }
    fn relation(&mut self, name: &'static str) -> Result<Relation, String> {
        let s = self.string(name)?;
        Relation::parse(&s)
            .ok_or_else(|| format!("{name}: expected \"less than\" or \"at least\", found {s:?}"))
    }
    fn strings(&mut self, name: &'static str) -> Result<Vec<String>, String> {
        match self.get(name) {
            Some(Value::Array(items)) if !items.is_empty() => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str().map(str::trim) {
                    Some(s) if !s.is_empty() => Ok(s.to_string()),
                    _ => Err(format!(
                        "{name}[{i}]: expected a non-empty string, found {v}"
                    )),
                })
                .collect(),
            Some(v) => Err(format!(
                "{name}: expected a non-empty list of strings, found {v}"
            )),
            None => Err(format!("{name}: missing")),
        }
    }
    /// An argument given but not read by this instruction is an error (a misspelt name would
    /// otherwise be silently ignored).
    fn finish(self) -> Result<(), String> {
        for (k, v) in self.map {
            if !v.is_null() && !self.used.contains(&k.as_str()) {
                return Err(format!("{k}: not an argument of this instruction"));
            }
        }
        Ok(())
    }
}

impl Instruction {
    /// Builds instruction `id` from its arguments. The error names the argument at fault.
    pub fn parse(id: &str, kwargs: &Map<String, Value>) -> Result<Instruction, String> {
        let mut a = Args {
            map: kwargs,
            used: Vec::new(),
        };
        let check = match id {
            "keywords:existence" => Check::KeywordsIncluded(a.strings("keywords")?),
            "keywords:frequency" => Check::KeywordFrequency {
                keyword: a.string("keyword")?,
                frequency: a.count("frequency", 1)?,
                relation: a.relation("relation")?,
            },
            "keywords:forbidden_words" => Check::KeywordsExcluded(a.strings("forbidden_words")?),
            "keywords:letter_frequency" => {
                let s = a.string("letter")?;
                let mut chars = s.chars();
                let letter = match (chars.next(), chars.next()) {
                    (Some(c), None) if c.is_ascii_alphabetic() => c.to_ascii_lowercase(),
                    _ => return Err(format!("letter: expected one letter a-z, found {s:?}")),
                };
                Check::LetterFrequency {
                    letter,
                    frequency: a.count("let_frequency", 1)?,
                    relation: a.relation("let_relation")?,
                }
            }
            "language:response_language" => {
                let code = a.string("language")?;
                if !language::DETECTABLE.contains(&code.as_str()) {
                    return Err(format!(
                        "language: {code:?} is not a language the detector tells (one of {})",
                        language::DETECTABLE.join(", ")
                    ));
                }
                Check::ResponseLanguage(code)
            }
            "length_constraints:number_sentences" => Check::Sentences {
                count: a.count("num_sentences", 1)?,
                relation: a.relation("relation")?,
            },
            "length_constraints:number_paragraphs" => {
                Check::ParagraphsDivided(a.count("num_paragraphs", 1)?)
            }
            "length_constraints:number_words" => Check::Words {
                count: a.count("num_words", 1)?,
                relation: a.relation("relation")?,
            },
            "length_constraints:nth_paragraph_first_word" => {
                let paragraphs = a.count("num_paragraphs", 1)?;
                let nth = a.count("nth_paragraph", 1)?;
                if nth > paragraphs {
                    return Err(format!(
                        "nth_paragraph: {nth} is past num_paragraphs ({paragraphs})"
                    ));
                }
                Check::NthParagraphFirstWord {
                    paragraphs,
                    nth,
                    first_word: a.string("first_word")?.to_lowercase(),
                }
            }
            "detectable_content:number_placeholders" => {
                Check::Placeholders(a.count("num_placeholders", 1)?)
            }
            "detectable_content:postscript" => Check::Postscript(a.string("postscript_marker")?),
            "detectable_format:number_bullet_lists" => {
                Check::BulletList(a.count("num_bullets", 1)?)
            }
            "detectable_format:constrained_response" => Check::ConstrainedResponse,
            "detectable_format:number_highlighted_sections" => {
                Check::HighlightedSections(a.count("num_highlights", 1)?)
            }
            "detectable_format:multiple_sections" => Check::Sections {
                splitter: a.string("section_spliter")?,
                count: a.count("num_sections", 1)?,
            },
            "detectable_format:json_format" => Check::Json,
            "detectable_format:title" => Check::Title,
            "combination:two_responses" => Check::TwoResponses,
            "combination:repeat_prompt" => Check::RepeatPrompt(a.string("prompt_to_repeat")?),
            "startend:end_checker" => Check::EndPhrase(a.string("end_phrase")?),
            "startend:start_checker" => Check::StartPhrase(a.string("start_phrase")?),
            "change_case:capital_word_frequency" => Check::CapitalWordFrequency {
                frequency: a.count("capital_frequency", 1)?,
                relation: a.relation("capital_relation")?,
            },
            "change_case:english_capital" => Check::AllCapitals,
            "change_case:english_lowercase" => Check::AllLowercase,
            "punctuation:no_comma" => Check::NoComma,
            "startend:quotation" => Check::Quotation,
            other => {
                return Err(format!(
                    "unknown instruction id {other:?} (known: {})",
                    INSTRUCTION_IDS.join(", ")
                ))
            }
        };
        a.finish()?;
        Ok(Instruction {
            id: id.to_string(),
            check,
        })
    }

    /// Whether `response` follows the instruction (one variant; see [`follows_strict`] and
    /// [`follows_loose`] for IFEval's rules around it).
    pub fn check(&self, response: &str) -> bool {
        self.check.holds(response)
    }
}

impl Check {
    pub fn holds(&self, r: &str) -> bool {
        match self {
            Check::KeywordsIncluded(words) => {
                let lower = r.to_lowercase();
                words.iter().all(|w| lower.contains(&w.to_lowercase()))
            }
            Check::KeywordFrequency {
                keyword,
                frequency,
                relation,
            } => {
                let n = r.to_lowercase().matches(&keyword.to_lowercase()).count();
                relation.holds(n, *frequency)
            }
            Check::KeywordsExcluded(words) => {
                let lower = r.to_lowercase();
                !words
                    .iter()
                    .any(|w| contains_whole_word(&lower, &w.to_lowercase()))
            }
            Check::LetterFrequency {
                letter,
                frequency,
                relation,
            } => {
                let n = r
                    .chars()
                    .filter(|c| c.to_ascii_lowercase() == *letter)
                    .count();
                relation.holds(n, *frequency)
            }
            Check::ResponseLanguage(code) => match language::detect(r) {
                Detected::Language(l) => l == code,
                Detected::NoLetters => true,
                Detected::Unknown => false,
            },
            Check::Sentences { count, relation } => relation.holds(count_sentences(r), *count),
            Check::ParagraphsDivided(n) => paragraphs_divided(r) == Some(*n),
            Check::Words { count, relation } => relation.holds(count_words(r), *count),
            Check::NthParagraphFirstWord {
                paragraphs,
                nth,
                first_word,
            } => nth_paragraph_first_word(r, *paragraphs, *nth, first_word),
            Check::Placeholders(n) => count_placeholders(r) >= *n,
            Check::Postscript(marker) => has_postscript(r, marker),
            Check::BulletList(n) => count_bullets(r) == *n,
            Check::ConstrainedResponse => {
                let t = r.trim();
                CONSTRAINED_RESPONSES.iter().any(|o| t.contains(o))
            }
            Check::HighlightedSections(n) => count_highlights(r) >= *n,
            Check::Sections { splitter, count } => count_sections(r, splitter) >= *count,
            Check::Json => is_json(r),
            Check::Title => has_title(r),
            Check::TwoResponses => two_responses(r),
            Check::RepeatPrompt(p) => r
                .trim()
                .to_lowercase()
                .starts_with(&p.trim().to_lowercase()),
            Check::StartPhrase(p) => r
                .trim()
                .trim_start_matches('"')
                .to_lowercase()
                .starts_with(&p.trim().to_lowercase()),
            Check::EndPhrase(p) => r
                .trim()
                .trim_matches('"')
                .to_lowercase()
                .ends_with(&p.trim().to_lowercase()),
            Check::CapitalWordFrequency {
                frequency,
                relation,
            } => relation.holds(count_capital_words(r), *frequency),
            Check::AllCapitals => is_upper(r) && english_or_undetectable(r),
            Check::AllLowercase => is_lower(r) && english_or_undetectable(r),
            Check::NoComma => !r.contains(','),
            Check::Quotation => {
                let t = r.trim();
                t.chars().count() > 1 && t.starts_with('"') && t.ends_with('"')
            }
        }
    }
}

fn english_or_undetectable(r: &str) -> bool {
    matches!(
        language::detect(r),
        Detected::Language("en") | Detected::NoLetters
    )
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `word` occurs in `text` with no word character on either side (a regex `\bword\b`).
fn contains_whole_word(text: &str, word: &str) -> bool {
    if word.is_empty() {
        return false;
    }
    text.match_indices(word).any(|(i, m)| {
        let before = text[..i].chars().next_back();
        let after = text[i + m.len()..].chars().next();
        let edge = |c: Option<char>, inner: Option<char>| match (c, inner) {
            (Some(c), Some(w)) => !(is_word_char(c) && is_word_char(w)),
            _ => true,
        };
        edge(before, word.chars().next()) && edge(after, word.chars().next_back())
    })
}

/// Words as IFEval counts them: maximal runs of letters, digits and `_` (regex `\w+`).
pub fn count_words(text: &str) -> usize {
    text.split(|c: char| !is_word_char(c))
        .filter(|w| !w.is_empty())
        .count()
}

/// Abbreviations whose period does not end a sentence (lowercase, without the period).
const ABBREVIATIONS: &[&str] = &[
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "inc", "ltd",
    "co", "no", "fig", "approx", "capt", "lt", "mt", "ph.d", "u.s", "a.m", "p.m",
];

/// Sentences, split by rule: a run of `.`, `!` or `?` (with closing quotes or brackets after
/// it) followed by whitespace or the end closes a sentence, except a period after an
/// abbreviation ([`ABBREVIATIONS`]), after a single letter (an initial) or after a number (a
/// list marker such as `1.`). A piece counts when it holds a letter or digit.
pub fn count_sentences(text: &str) -> usize {
    let chars: Vec<char> = text.chars().collect();
    let mut count = 0;
    let mut has_content = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() {
            has_content = true;
        }
        if matches!(c, '.' | '!' | '?') {
            let mut j = i;
            while j < chars.len() && matches!(chars[j], '.' | '!' | '?') {
                j += 1;
            }
            let only_period = j == i + 1 && c == '.';
            while j < chars.len() && matches!(chars[j], '"' | '\'' | ')' | ']' | '”' | '’') {
                j += 1;
            }
            let at_break = j == chars.len() || chars[j].is_whitespace();
            if at_break && !(only_period && period_is_not_a_stop(&chars, i)) {
                if has_content {
                    count += 1;
                }
                has_content = false;
            }
            i = j;
            continue;
        }
        i += 1;
    }
    if has_content {
        count += 1;
    }
    count
}

/// Whether the period at `dot` belongs to the word before it (abbreviation, initial, number).
fn period_is_not_a_stop(chars: &[char], dot: usize) -> bool {
    let mut start = dot;
    while start > 0 && !chars[start - 1].is_whitespace() {
        start -= 1;
    }
    let word: String = chars[start..dot]
        .iter()
        .collect::<String>()
        .trim_start_matches(['(', '"', '\''])
        .to_lowercase();
    if word.is_empty() {
        return false;
    }
    let single_letter = word.chars().count() == 1 && word.chars().all(char::is_alphabetic);
    let number = word.chars().all(|c| c.is_ascii_digit());
    ABBREVIATIONS.contains(&word.as_str()) || single_letter || number
}

/// Paragraphs separated by `***`, or `None` when an inner paragraph is empty (IFEval's rule:
/// empty pieces at either end are dropped, an empty piece inside fails).
fn paragraphs_divided(text: &str) -> Option<usize> {
    let pieces: Vec<&str> = text.split("***").collect();
    let mut n = pieces.len();
    for (i, p) in pieces.iter().enumerate() {
        if p.trim().is_empty() {
            if i == 0 || i == pieces.len() - 1 {
                n -= 1;
            } else {
                return None;
            }
        }
    }
    Some(n)
}

fn nth_paragraph_first_word(text: &str, want: usize, nth: usize, first: &str) -> bool {
    let pieces: Vec<&str> = text.split("\n\n").collect();
    let n = pieces.iter().filter(|p| !p.trim().is_empty()).count();
    // IFEval indexes the raw pieces (empty ones included) once the count allows `nth`.
    if nth == 0 || nth > n {
        return false;
    }
    let Some(paragraph) = pieces.get(nth - 1).map(|p| p.trim()) else {
        return false;
    };
    let Some(word) = paragraph.split_whitespace().next() else {
        return false;
    };
    let word: String = word
        .trim_start_matches(['\'', '"'])
        .chars()
        .take_while(|c| !matches!(c, '.' | ',' | '?' | '!' | '\'' | '"'))
        .flat_map(char::to_lowercase)
        .collect();
    n == want && word == first
}

/// `[...]` spans within one line (IFEval's `\[.*?\]`).
fn count_placeholders(text: &str) -> usize {
    text.lines()
        .map(|line| {
            let mut n = 0;
            let mut rest = line;
            while let Some(open) = rest.find('[') {
                match rest[open + 1..].find(']') {
                    Some(close) => {
                        n += 1;
                        rest = &rest[open + 1 + close + 1..];
                    }
                    None => break,
                }
            }
            n
        })
        .sum()
}

/// IFEval's postscript patterns: `p. ?p. ?s` for `P.P.S`, `p. ?s.` for `P.S.`, else the marker,
/// anywhere in the lowercased response.
fn has_postscript(text: &str, marker: &str) -> bool {
    let lower = text.to_lowercase();
    match marker {
        "P.P.S" => has_spaced(&lower, &["p.", "p.", "s"]),
        "P.S." => has_spaced(&lower, &["p.", "s."]),
        m => lower.contains(&m.to_lowercase()),
    }
}

/// Whether `parts` occur in `text` one after another, with at most one whitespace character
/// between two parts (a regex `part1\s?part2...`; each part starts with a non-space).
fn has_spaced(text: &str, parts: &[&str]) -> bool {
    text.char_indices().any(|(start, _)| {
        let mut rest = &text[start..];
        for (k, part) in parts.iter().enumerate() {
            if k > 0 {
                if let Some(c) = rest.chars().next().filter(|c| c.is_whitespace()) {
                    rest = &rest[c.len_utf8()..];
                }
            }
            match rest.strip_prefix(part) {
                Some(r) => rest = r,
                None => return false,
            }
        }
        true
    })
}

/// Lines that are markdown bullets: `* item` (not `**`) or `- item`.
fn count_bullets(text: &str) -> usize {
    text.lines()
        .filter(|line| {
            let t = line.trim_start();
            if let Some(rest) = t.strip_prefix('*') {
                !rest.is_empty() && !rest.starts_with('*')
            } else {
                t.starts_with('-')
            }
        })
        .count()
}

/// IFEval's highlight count: `*text*` spans on one line with non-blank text, plus `**text**`
/// spans with non-blank text (a bold span is seen by the second pattern only).
fn count_highlights(text: &str) -> usize {
    let mut n = 0;
    for line in text.lines() {
        let b: Vec<char> = line.chars().collect();
        // Single asterisks: `\*[^\n\*]*\*`, scanned left to right without overlap.
        let mut i = 0;
        while i < b.len() {
            if b[i] == '*' {
                if let Some(k) = b[i + 1..].iter().position(|&c| c == '*') {
                    let inner: String = b[i + 1..i + 1 + k].iter().collect();
                    if !inner.trim().is_empty() {
                        n += 1;
                    }
                    i += k + 2;
                    continue;
                }
            }
            i += 1;
        }
        // Double asterisks: `\*\*[^\n\*]*\*\*`.
        let mut i = 0;
        while i + 1 < b.len() {
            if b[i] == '*' && b[i + 1] == '*' {
                let body = &b[i + 2..];
                if let Some(k) = body.iter().position(|&c| c == '*') {
                    if body.get(k + 1) == Some(&'*') {
                        let inner: String = body[..k].iter().collect();
                        if !inner.trim().is_empty() {
                            n += 1;
                        }
                        i += k + 4;
                        continue;
                    }
                }
            }
            i += 1;
        }
    }
    n
}

/// Section markers `{splitter} N` (at most one whitespace between, case-sensitive).
fn count_sections(text: &str, splitter: &str) -> usize {
    let mut n = 0;
    let mut rest = text;
    while let Some(at) = rest.find(splitter) {
        let after = &rest[at + splitter.len()..];
        let mut tail = after;
        if let Some(c) = tail.chars().next().filter(|c| c.is_whitespace()) {
            tail = &tail[c.len_utf8()..];
        }
        if tail.starts_with(|c: char| c.is_ascii_digit()) {
            n += 1;
        }
        rest = after;
    }
    n
}

fn is_json(text: &str) -> bool {
    let mut t = text.trim();
    for fence in ["```json", "```Json", "```JSON", "```"] {
        if let Some(rest) = t.strip_prefix(fence) {
            t = rest;
            break;
        }
    }
    let t = t.strip_suffix("```").unwrap_or(t).trim();
    serde_json::from_str::<Value>(t).is_ok()
}

/// A line holding `<<title>>` with a non-blank title (IFEval's greedy `<<[^\n]+>>`).
fn has_title(text: &str) -> bool {
    text.lines().any(|line| {
        let (Some(open), Some(close)) = (line.find("<<"), line.rfind(">>")) else {
            return false;
        };
        close >= open + 3
            && !line[open..close + 2]
                .trim_start_matches('<')
                .trim_end_matches('>')
                .trim()
                .is_empty()
    })
}

fn two_responses(text: &str) -> bool {
    let pieces: Vec<&str> = text.split("******").collect();
    let mut valid = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        if p.trim().is_empty() {
            if i != 0 && i != pieces.len() - 1 {
                return false;
            }
        } else {
            valid.push(p.trim());
        }
    }
    valid.len() == 2 && valid[0] != valid[1]
}

/// Python's `str.isupper`: at least one cased letter, and no lowercase one.
fn is_upper(text: &str) -> bool {
    text.chars().any(char::is_uppercase) && !text.chars().any(char::is_lowercase)
}

/// Python's `str.islower`.
fn is_lower(text: &str) -> bool {
    text.chars().any(char::is_lowercase) && !text.chars().any(char::is_uppercase)
}

/// Tokens (runs of letters, digits, `'` and `-`) that are all capitals, as `str.isupper`.
fn count_capital_words(text: &str) -> usize {
    text.split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '-'))
        .filter(|w| is_upper(w))
        .count()
}

/// IFEval's strict rule: a non-blank response that passes the check.
pub fn follows_strict(inst: &Instruction, response: &str) -> bool {
    !response.trim().is_empty() && inst.check(response)
}

/// IFEval's eight loose variants of a response (see the module doc).
pub fn loose_variants(response: &str) -> [String; 8] {
    let lines: Vec<&str> = response.split('\n').collect();
    let join = |ls: &[&str]| ls.join("\n").trim().to_string();
    let n = lines.len();
    let remove_first = join(lines.get(1..).unwrap_or(&[]));
    let remove_last = join(&lines[..n.saturating_sub(1)]);
    let remove_both = if n >= 2 {
        join(&lines[1..n - 1])
    } else {
        String::new()
    };
    let strip = |s: &str| s.replace('*', "");
    [
        response.to_string(),
        strip(response),
        remove_first.clone(),
        remove_last.clone(),
        remove_both.clone(),
        strip(&remove_first),
        strip(&remove_last),
        strip(&remove_both),
    ]
}

/// IFEval's loose rule: any non-blank variant passes.
pub fn follows_loose(inst: &Instruction, response: &str) -> bool {
    loose_variants(response)
        .iter()
        .any(|v| !v.trim().is_empty() && inst.check(v))
}

/// One prompt's instructions, strict and loose, in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Verdicts {
    pub strict: Vec<bool>,
    pub loose: Vec<bool>,
}

impl Verdicts {
    pub fn all_strict(&self) -> bool {
        self.strict.iter().all(|&b| b)
    }
    pub fn all_loose(&self) -> bool {
        self.loose.iter().all(|&b| b)
    }
}

/// Scores one response against a prompt's instructions.
pub fn score(instructions: &[Instruction], response: &str) -> Verdicts {
    Verdicts {
        strict: instructions
            .iter()
            .map(|i| follows_strict(i, response))
            .collect(),
        loose: instructions
            .iter()
            .map(|i| follows_loose(i, response))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn inst(id: &str, kwargs: Value) -> Instruction {
        Instruction::parse(id, kwargs.as_object().expect("kwargs object"))
            .unwrap_or_else(|e| panic!("{id}: {e}"))
    }

    /// Asserts that `yes` passes and `no` fails the instruction (strict rule).
    fn pos_neg(i: &Instruction, yes: &str, no: &str) {
        assert!(follows_strict(i, yes), "{}: should pass: {yes:?}", i.id);
        assert!(!follows_strict(i, no), "{}: should fail: {no:?}", i.id);
    }

    #[test]
    fn keywords_existence() {
        let i = inst(
            "keywords:existence",
            json!({"keywords": ["river", "Stone"]}),
        );
        pos_neg(
            &i,
            "The RIVER carved the stone.",
            "The river carved the rock.",
        );
    }

    #[test]
    fn keywords_frequency() {
        let at_least = inst(
            "keywords:frequency",
            json!({"keyword": "tea", "frequency": 3, "relation": "at least"}),
        );
        pos_neg(&at_least, "Tea, tea and more TEA.", "Tea and tea.");
        let less = inst(
            "keywords:frequency",
            json!({"keyword": "tea", "frequency": 2, "relation": "less than"}),
        );
        pos_neg(&less, "One tea please.", "Tea or tea?");
    }

    #[test]
    fn keywords_forbidden_are_whole_words() {
        let i = inst(
            "keywords:forbidden_words",
            json!({"forbidden_words": ["cat", "dog"]}),
        );
        // "category" and "hotdogs" hold the words only inside longer ones.
        pos_neg(&i, "A category of hotdogs.", "My Cat sleeps.");
        assert!(!follows_strict(&i, "dog."));
    }

    #[test]
    fn letter_frequency() {
        let at_least = inst(
            "keywords:letter_frequency",
            json!({"letter": "Z", "let_frequency": 3, "let_relation": "at least"}),
        );
        pos_neg(&at_least, "Zebras zigzag, buzz.", "A zebra.");
        let less = inst(
            "keywords:letter_frequency",
            json!({"letter": "e", "let_frequency": 2, "let_relation": "less than"}),
        );
        pos_neg(&less, "A cat sat.", "The tree.");
    }

    #[test]
    fn response_language() {
        let fr = inst("language:response_language", json!({"language": "fr"}));
        pos_neg(
            &fr,
            "Le soleil est chaud et la mer est bleue.",
            "The sun is hot and the sea is blue.",
        );
        let ru = inst("language:response_language", json!({"language": "ru"}));
        pos_neg(&ru, "Солнце светит, и море синее.", "Le soleil est là.");
        // No letters: undetectable, counted as followed (IFEval's rule).
        assert!(follows_strict(&ru, "42 + 17 = 59"));
    }

    #[test]
    fn number_sentences() {
        let less = inst(
            "length_constraints:number_sentences",
            json!({"num_sentences": 3, "relation": "less than"}),
        );
        pos_neg(
            &less,
            "Dr. Smith arrived at 3.30 p.m. today. He left!",
            "One. Two. Three.",
        );
        let at_least = inst(
            "length_constraints:number_sentences",
            json!({"num_sentences": 3, "relation": "at least"}),
        );
        pos_neg(
            &at_least,
            "Is it? Yes! It is.",
            "Only one sentence here, e.g. this.",
        );
        assert_eq!(count_sentences("1. Milk\n2. Eggs"), 1);
        assert_eq!(count_sentences("He said \"stop.\" Then he left."), 2);
        assert_eq!(count_sentences("   "), 0);
    }

    #[test]
    fn number_paragraphs_with_dividers() {
        let i = inst(
            "length_constraints:number_paragraphs",
            json!({"num_paragraphs": 3}),
        );
        pos_neg(&i, "One.\n***\nTwo.\n***\nThree.\n***", "One.\n***\nTwo.");
        // An empty paragraph between dividers fails.
        assert!(!follows_strict(&i, "One.\n***\n\n***\nTwo.\n***\nThree."));
    }

    #[test]
    fn number_words() {
        let less = inst(
            "length_constraints:number_words",
            json!({"num_words": 5, "relation": "less than"}),
        );
        pos_neg(&less, "It's two-fold.", "One two three four five.");
        assert_eq!(count_words("It's two-fold, isn't_it?"), 6);
        let at_least = inst(
            "length_constraints:number_words",
            json!({"num_words": 4, "relation": "at least"}),
        );
        pos_neg(&at_least, "one two three four", "one two three");
    }

    #[test]
    fn nth_paragraph_first_word() {
        let i = inst(
            "length_constraints:nth_paragraph_first_word",
            json!({"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "Finally"}),
        );
        pos_neg(
            &i,
            "First things first.\n\n\"Finally, we rest.",
            "First things first.\n\nThen we rest.",
        );
        // Right word, wrong paragraph count.
        assert!(!follows_strict(&i, "A.\n\nFinally b.\n\nC."));
    }

    #[test]
    fn placeholders() {
        let i = inst(
            "detectable_content:number_placeholders",
            json!({"num_placeholders": 2}),
        );
        pos_neg(
            &i,
            "Dear [name], see you at [place].",
            "Dear [name], see you.",
        );
        // A bracket closed on the next line is not a placeholder.
        assert!(!follows_strict(&i, "[a\n] and [b]"));
    }

    #[test]
    fn postscript() {
        let ps = inst(
            "detectable_content:postscript",
            json!({"postscript_marker": "P.S."}),
        );
        pos_neg(
            &ps,
            "Thanks.\n\np. s. Bring snacks.",
            "Thanks. PS bring snacks.",
        );
        let pps = inst(
            "detectable_content:postscript",
            json!({"postscript_marker": "P.P.S"}),
        );
        pos_neg(&pps, "Bye.\nP.P.S. More.", "Bye.\nP.S. More.");
        let other = inst(
            "detectable_content:postscript",
            json!({"postscript_marker": "Note:"}),
        );
        pos_neg(&other, "Done.\nNOTE: call me.", "Done.");
    }

    #[test]
    fn bullet_lists() {
        let i = inst(
            "detectable_format:number_bullet_lists",
            json!({"num_bullets": 3}),
        );
        pos_neg(
            &i,
            "Items:\n* apples\n  - pears\n* plums",
            "Items:\n* apples\n**bold** line\n* plums",
        );
    }

    #[test]
    fn constrained_response() {
        let i = inst("detectable_format:constrained_response", json!({}));
        pos_neg(&i, "  My answer is maybe.  ", "My answer is probably.");
    }

    #[test]
    fn highlighted_sections() {
        let i = inst(
            "detectable_format:number_highlighted_sections",
            json!({"num_highlights": 2}),
        );
        pos_neg(
            &i,
            "*Intro* text and **Details** here.",
            "*Intro* text and ** ** empty and * * too.",
        );
        assert_eq!(count_highlights("*a* *b* **c**"), 3);
    }

    #[test]
    fn multiple_sections() {
        let i = inst(
            "detectable_format:multiple_sections",
            json!({"section_spliter": "SECTION", "num_sections": 2}),
        );
        pos_neg(
            &i,
            "SECTION 1\nFirst.\nSECTION 2\nSecond.",
            "SECTION 1\nFirst.\nSection 2\nSecond.",
        );
    }

    #[test]
    fn json_format() {
        let i = inst("detectable_format:json_format", json!({}));
        pos_neg(
            &i,
            "```json\n{\"a\": [1, 2]}\n```",
            "Here it is: {\"a\": 1}",
        );
        assert!(follows_strict(&i, "[1, 2, 3]"));
    }

    #[test]
    fn title() {
        let i = inst("detectable_format:title", json!({}));
        pos_neg(&i, "<<Ode to Rust>>\nLines.", "<< >>\n<<Broken\n>>");
    }

    #[test]
    fn two_responses_check() {
        let i = inst("combination:two_responses", json!({}));
        pos_neg(
            &i,
            "Yes, gladly.\n******\nNo, thanks.",
            "Same.\n******\nSame.",
        );
        assert!(!follows_strict(&i, "A\n******\n\n******\nB"));
    }

    #[test]
    fn repeat_prompt() {
        let i = inst(
            "combination:repeat_prompt",
            json!({"prompt_to_repeat": "Name a red fruit."}),
        );
        pos_neg(
            &i,
            "name a red fruit. A cherry.",
            "A cherry. Name a red fruit.",
        );
    }

    #[test]
    fn start_and_end_phrases() {
        let start = inst(
            "startend:start_checker",
            json!({"start_phrase": "In short"}),
        );
        pos_neg(&start, "\"In short, yes.", "Yes. In short, yes.");
        let end = inst(
            "startend:end_checker",
            json!({"end_phrase": "Any other questions?"}),
        );
        pos_neg(
            &end,
            "That is all. any other questions?\"  ",
            "Any other questions? That is all.",
        );
    }

    #[test]
    fn capital_word_frequency() {
        let at_least = inst(
            "change_case:capital_word_frequency",
            json!({"capital_frequency": 2, "capital_relation": "at least"}),
        );
        pos_neg(&at_least, "Use NASA and ESA data.", "Use Nasa data, OK?");
        let less = inst(
            "change_case:capital_word_frequency",
            json!({"capital_frequency": 2, "capital_relation": "less than"}),
        );
        pos_neg(&less, "Only NASA here.", "WE LOVE IT.");
    }

    #[test]
    fn english_capital_and_lowercase() {
        let up = inst("change_case:english_capital", json!({}));
        pos_neg(&up, "THE SUN IS HOT AND IT IS BRIGHT.", "THE SUN is hot.");
        // All capitals but not English.
        assert!(!follows_strict(
            &up,
            "LE SOLEIL EST CHAUD ET LA MER EST BLEUE."
        ));
        let low = inst("change_case:english_lowercase", json!({}));
        pos_neg(&low, "the sun is hot and it is bright.", "The sun is hot.");
        assert!(!follows_strict(
            &low,
            "le soleil est chaud et la mer est bleue."
        ));
    }

    #[test]
    fn no_comma() {
        let i = inst("punctuation:no_comma", json!({}));
        pos_neg(&i, "No commas here.", "One, two.");
    }

    #[test]
    fn quotation() {
        let i = inst("startend:quotation", json!({}));
        pos_neg(&i, "  \"Wrapped whole.\"\n", "\"Only the start.");
        assert!(!follows_strict(&i, "\""));
    }

    #[test]
    fn blank_responses_never_pass() {
        let i = inst("punctuation:no_comma", json!({}));
        assert!(!follows_strict(&i, "  \n "));
        assert!(!follows_loose(&i, "  \n "));
    }

    #[test]
    fn loose_variants_drop_lines_and_asterisks() {
        let v = loose_variants("Sure! Here:\n**Answer**\nBye");
        assert_eq!(v[0], "Sure! Here:\n**Answer**\nBye");
        assert_eq!(v[1], "Sure! Here:\nAnswer\nBye");
        assert_eq!(v[2], "**Answer**\nBye");
        assert_eq!(v[3], "Sure! Here:\n**Answer**");
        assert_eq!(v[4], "**Answer**");
        assert_eq!(v[5], "Answer\nBye");
        assert_eq!(v[6], "Sure! Here:\nAnswer");
        assert_eq!(v[7], "Answer");
        // A quotation that fails strictly because of a preamble line passes loosely.
        let q = inst("startend:quotation", json!({}));
        let r = "Here you go:\n\"All wrapped.\"";
        assert!(!follows_strict(&q, r));
        assert!(follows_loose(&q, r));
        // Per instruction and per prompt: strict fails the prompt, loose passes it.
        let s = score(&[q, inst("punctuation:no_comma", json!({}))], r);
        assert_eq!(s.strict, vec![false, true]);
        assert_eq!(s.loose, vec![true, true]);
        assert!(!s.all_strict() && s.all_loose());
    }

    #[test]
    fn bad_arguments_are_named() {
        let err =
            |id: &str, kw: Value| Instruction::parse(id, kw.as_object().unwrap()).unwrap_err();
        assert!(err(
            "keywords:frequency",
            json!({"keyword": "a", "frequency": 2})
        )
        .starts_with("relation: missing"));
        assert!(err(
            "keywords:frequency",
            json!({"keyword": "a", "frequency": 2, "relation": "at most"})
        )
        .starts_with("relation: expected"));
        assert!(err(
            "length_constraints:number_words",
            json!({"num_words": -3, "relation": "at least"})
        )
        .starts_with("num_words: expected an integer"));
        assert!(err("punctuation:no_comma", json!({"comma": true}))
            .starts_with("comma: not an argument"));
        assert!(err(
            "keywords:letter_frequency",
            json!({"letter": "ab", "let_frequency": 1, "let_relation": "at least"})
        )
        .starts_with("letter: expected one letter"));
        assert!(err("language:response_language", json!({"language": "xx"}))
            .starts_with("language: \"xx\" is not"));
        assert!(err("nope:nothing", json!({})).starts_with("unknown instruction id"));
        // Null arguments are absent, as in IFEval's files.
        let ok = Instruction::parse(
            "punctuation:no_comma",
            json!({"num_words": null}).as_object().unwrap(),
        );
        assert!(ok.is_ok());
    }
}
