//! Verifiable-instruction prompt files: JSONL in IFEval's format, one prompt a line,
//!
//! ```json
//! {"key": 7, "prompt": "...", "instruction_id_list": ["punctuation:no_comma", ...],
//!  "kwargs": [{}, ...]}
//! ```
//!
//! validated on load: every error names the file, the line and the field (`kwargs[1].num_words`),
//! and every bad line is reported, not only the first. `key` is optional (the line number stands
//! in for it) and must be unique when given.

use super::ifeval::Instruction;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The prompt set shipped with lorafit (`data/ifeval_prompts.jsonl`).
pub const BUNDLED: &str = include_str!("../../data/ifeval_prompts.jsonl");
pub const BUNDLED_NAME: &str = "data/ifeval_prompts.jsonl";

/// One prompt with its instructions.
#[derive(Debug, Clone, PartialEq)]
pub struct InstructionPrompt {
    /// 1-based line in the source file.
    pub line: usize,
    /// The row's `key`, or its line number when the row has none.
    pub key: i64,
    pub prompt: String,
    pub instructions: Vec<Instruction>,
}

/// Most errors listed before the rest are counted.
const MAX_LISTED_ERRORS: usize = 20;

/// Reads and validates a prompt file.
pub fn load_prompts(path: &Path) -> Result<Vec<InstructionPrompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_prompts(&text, &path.display().to_string())
}

/// Validates prompt-file text; `name` is the file named in errors.
pub fn parse_prompts(text: &str, name: &str) -> Result<Vec<InstructionPrompt>> {
    let mut prompts = Vec::new();
    let mut errors = Vec::new();
    let mut keys: BTreeMap<i64, usize> = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        match parse_row(raw, line) {
            Ok(p) => {
                if let Some(first) = keys.insert(p.key, line) {
                    errors.push(format!(
                        "{name}:{line}: field \"key\": {} was already used on line {first}",
                        p.key
                    ));
                } else {
                    prompts.push(p);
                }
            }
            Err(e) => errors.push(format!("{name}:{line}: {e}")),
        }
    }
    if !errors.is_empty() {
        let n = errors.len();
        let mut msg = errors
            .into_iter()
            .take(MAX_LISTED_ERRORS)
            .collect::<Vec<_>>()
            .join("\n");
        if n > MAX_LISTED_ERRORS {
            msg.push_str(&format!("\n... and {} more", n - MAX_LISTED_ERRORS));
        }
        bail!("{n} bad prompt row(s):\n{msg}");
    }
    if prompts.is_empty() {
        bail!("{name}: no prompts");
    }
    Ok(prompts)
}

fn parse_row(raw: &str, line: usize) -> Result<InstructionPrompt, String> {
    let v: Value = serde_json::from_str(raw).map_err(|e| format!("not valid JSON: {e}"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| "expected a JSON object".to_string())?;
    for k in obj.keys() {
        if !matches!(
            k.as_str(),
            "key" | "prompt" | "instruction_id_list" | "kwargs"
        ) {
            return Err(format!(
                "field {k:?}: unknown (expected key, prompt, instruction_id_list, kwargs)"
            ));
        }
    }
    let key = match obj.get("key") {
        None | Some(Value::Null) => line as i64,
        Some(k) => k
            .as_i64()
            .ok_or_else(|| format!("field \"key\": expected an integer, found {k}"))?,
    };
    let prompt = match obj.get("prompt") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
        Some(Value::String(_)) => return Err("field \"prompt\": empty".into()),
        Some(v) => return Err(format!("field \"prompt\": expected a string, found {v}")),
        None => return Err("field \"prompt\": missing".into()),
    };
    let ids = match obj.get("instruction_id_list") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(v) => {
            return Err(format!(
                "field \"instruction_id_list\": expected a non-empty list, found {v}"
            ))
        }
        None => return Err("field \"instruction_id_list\": missing".into()),
    };
    let kwargs = match obj.get("kwargs") {
        Some(Value::Array(a)) => a,
        Some(v) => return Err(format!("field \"kwargs\": expected a list, found {v}")),
        None => return Err("field \"kwargs\": missing".into()),
    };
    if kwargs.len() != ids.len() {
        return Err(format!(
            "field \"kwargs\": {} entries for {} instructions (one object per instruction)",
            kwargs.len(),
            ids.len()
        ));
    }
    let mut instructions = Vec::with_capacity(ids.len());
    for (i, (id, kw)) in ids.iter().zip(kwargs).enumerate() {
        let id = id.as_str().ok_or_else(|| {
            format!("field \"instruction_id_list[{i}]\": expected a string, found {id}")
        })?;
        let empty = serde_json::Map::new();
        let kw = match kw {
            Value::Object(m) => m,
            Value::Null => &empty,
            v => {
                return Err(format!(
                    "field \"kwargs[{i}]\": expected an object, found {v}"
                ))
            }
        };
        let inst = Instruction::parse(id, kw).map_err(|e| {
            if e.starts_with("unknown instruction id") {
                format!("field \"instruction_id_list[{i}]\": {e}")
            } else {
                // The instruction's error reads "argument: what is wrong".
                match e.split_once(": ") {
                    Some((arg, what)) => format!("field \"kwargs[{i}].{arg}\": {what}"),
                    None => format!("field \"kwargs[{i}]\": {e}"),
                }
            }
        })?;
        if instructions.iter().any(|x: &Instruction| x.id == inst.id) {
            return Err(format!(
                "field \"instruction_id_list[{i}]\": {id} is listed twice"
            ));
        }
        instructions.push(inst);
    }
    Ok(InstructionPrompt {
        line,
        key,
        prompt,
        instructions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::ifeval::{Check, INSTRUCTION_IDS};

    #[test]
    fn bundled_prompts_load_and_cover_every_instruction() {
        let prompts = parse_prompts(BUNDLED, BUNDLED_NAME).unwrap();
        assert!(prompts.len() >= 150, "{} prompts", prompts.len());
        for id in INSTRUCTION_IDS {
            let n = prompts
                .iter()
                .flat_map(|p| &p.instructions)
                .filter(|i| i.id == *id)
                .count();
            assert!(n >= 3, "{id}: only {n} prompts use it");
        }
        // repeat_prompt's text is the prompt's own first sentence(s).
        for p in &prompts {
            for i in &p.instructions {
                if let Check::RepeatPrompt(r) = &i.check {
                    assert!(p.prompt.starts_with(r.as_str()), "line {}", p.line);
                }
            }
        }
    }

    #[test]
    fn rows_in_ifeval_form_with_null_arguments_load() {
        let row = r#"{"key": 1001, "prompt": "Write a haiku.", "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"], "kwargs": [{"num_words": null}, {"num_words": 20, "relation": "less than", "keyword": null}]}"#;
        let p = parse_prompts(row, "x.jsonl").unwrap();
        assert_eq!(p[0].key, 1001);
        assert_eq!(p[0].instructions.len(), 2);
        assert_eq!(p[0].instructions[1].id, "length_constraints:number_words");
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let text = [
            r#"{"prompt": "ok", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}"#,
            "",
            r#"{"prompt": "a", "instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": "ten", "relation": "at least"}]}"#,
            r#"{"prompt": "b", "instruction_id_list": ["punctuation:no_comma"], "kwargs": []}"#,
            r#"{"prompt": "c", "instruction_id_list": ["punctuation:nocomma"], "kwargs": [{}]}"#,
            r#"{"prompt": "d", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}], "extra": 1}"#,
            r#"{"key": 1, "prompt": "e", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}"#,
            "{not json",
        ]
        .join("\n");
        let err = parse_prompts(&text, "p.jsonl").unwrap_err().to_string();
        assert!(err.starts_with("6 bad prompt row(s)"), "{err}");
        for want in [
            "p.jsonl:3: field \"kwargs[0].num_words\": expected an integer >= 1, found \"ten\"",
            "p.jsonl:4: field \"kwargs\": 0 entries for 1 instructions",
            "p.jsonl:5: field \"instruction_id_list[0]\": unknown instruction id \"punctuation:nocomma\"",
            "p.jsonl:6: field \"extra\": unknown",
            "p.jsonl:7: field \"key\": 1 was already used on line 1",
            "p.jsonl:8: not valid JSON",
        ] {
            assert!(err.contains(want), "missing {want:?} in\n{err}");
        }
    }
}
