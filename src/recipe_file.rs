//! TRL's recipes read as a settings table, so that one brought over runs through the same names,
//! checks and refusals as a TOML file: YAML (`trl orpo --config recipe.yaml`) and JSON (which
//! transformers' argument parser also reads). Recipes are flat: `key: value` lines, with a list
//! as `[a, b]` or as `- item` lines under its key. That YAML subset is read here as PyYAML reads
//! it (`yes`/`no`/`on`/`off` are booleans, `null` or `~` or nothing leaves a setting at its
//! default, `1e-4` is a number as transformers casts it); what lies past it (a nested mapping, a
//! block string, anchors, a second document) is refused with its line, never guessed at. A JSON
//! value becomes a settings value here for the job server's configs too (`json_to_toml`).

use anyhow::{bail, Result};
use serde_json::Value;

/// A JSON recipe (one object of settings) as a table, a `null` setting left out; a nested
/// object is refused with its key, as YAML's nested mapping is.
pub fn json_table(text: &str) -> Result<toml::Table> {
    let Value::Object(map) = serde_json::from_str::<Value>(text)? else {
        bail!("not one JSON object of settings");
    };
    let mut out = toml::Table::new();
    for (key, v) in &map {
        if v.is_object() || v.as_array().is_some_and(|a| a.iter().any(Value::is_object)) {
            bail!("`{key}` holds a nested value; lorafit's settings are flat");
        }
        if let Some(value) = json_to_toml(key, v).map_err(anyhow::Error::msg)? {
            out.insert(key.clone(), value);
        }
    }
    Ok(out)
}

/// A JSON value as TOML (a settings table's value: the job server's configs, JSON recipes);
/// `null` means "unset" (the default) and yields None; a null inside a list or a number TOML
/// cannot hold is refused, naming the setting.
pub fn json_to_toml(key: &str, v: &Value) -> Result<Option<toml::Value>, String> {
    Ok(Some(match v {
        Value::Null => return Ok(None),
        Value::Bool(b) => toml::Value::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => toml::Value::Integer(i),
            (None, Some(_)) if n.is_u64() => {
                return Err(format!("setting `{key}`: {n} is too large"))
            }
            (None, Some(f)) => toml::Value::Float(f),
            (None, None) => return Err(format!("setting `{key}`: {n} is not a number TOML holds")),
        },
        Value::String(s) => toml::Value::String(s.clone()),
        Value::Array(items) => toml::Value::Array(
            items
                .iter()
                .map(|item| {
                    json_to_toml(key, item)?
                        .ok_or_else(|| format!("setting `{key}`: null inside a list"))
                })
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(map) => {
            let mut t = toml::Table::new();
            for (k, item) in map {
                if let Some(v) = json_to_toml(&format!("{key}.{k}"), item)? {
                    t.insert(k.clone(), v);
                }
            }
            toml::Value::Table(t)
        }
    }))
}

/// The YAML recipe `text` as a table of its settings (a `null` one left out).
pub fn table(text: &str) -> Result<toml::Table> {
    let mut out = toml::Table::new();
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, strip_comment(l)))
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    let mut i = 0;
    let mut documents = 0;
    while i < lines.len() {
        let (n, line) = lines[i];
        i += 1;
        if line.trim_end() == "---" {
            documents += 1;
            if documents > 1 || !out.is_empty() {
                bail!("line {n}: a second YAML document; a recipe is one mapping of settings");
            }
            continue;
        }
        if line.starts_with([' ', '\t']) {
            bail!(
                "line {n}: an indented line outside a list: `{}`",
                line.trim()
            );
        }
        if line.starts_with("- ") || line == "-" {
            bail!("line {n}: a list at the top; a recipe is a mapping of settings (`key: value`)");
        }
        let Some((key, value)) = split_key(line) else {
            bail!("line {n}: `{}` is not `key: value`", line.trim());
        };
        if out.contains_key(key) {
            bail!("line {n}: `{key}` is given twice");
        }
        let value = value.trim();
        if value.is_empty() {
            // A block under the key: a list of `- item` lines, or a mapping (refused).
            let mut items = Vec::new();
            while i < lines.len() && lines[i].1.starts_with([' ', '\t']) {
                let (m, item) = (lines[i].0, lines[i].1.trim());
                i += 1;
                match item.strip_prefix('-') {
                    Some(rest) if rest.is_empty() || rest.starts_with(' ') => {
                        match scalar(m, rest.trim())? {
                            Some(v) => items.push(v),
                            None => bail!("line {m}: `{key}` holds an empty item"),
                        }
                    }
                    _ => bail!(
                        "line {m}: `{key}` holds a mapping; lorafit's settings are flat \
                         (`key: value`, a list as `[a, b]`)"
                    ),
                }
            }
            if !items.is_empty() {
                out.insert(key.to_string(), toml::Value::Array(items));
            }
            continue;
        }
        if let Some(inner) = value.strip_prefix('[') {
            let Some(inner) = inner.strip_suffix(']') else {
                bail!("line {n}: `{key}`'s list does not end on its line");
            };
            let mut items = Vec::new();
            for part in inner.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                match scalar(n, part)? {
                    Some(v) => items.push(v),
                    None => bail!("line {n}: `{key}` holds an empty item"),
                }
            }
            out.insert(key.to_string(), toml::Value::Array(items));
            continue;
        }
        if value.starts_with('{') {
            bail!(
                "line {n}: `{key}` holds a mapping; lorafit's settings are flat \
                 (`key: value`, a list as `[a, b]`)"
            );
        }
        if let Some(v) = scalar(n, value)? {
            out.insert(key.to_string(), v);
        }
    }
    Ok(out)
}

/// The line without a comment: `#` at its start or after a space, outside quotes.
fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if prev == ' ' || prev == '\t' => return &line[..i],
            _ => {}
        }
        prev = c;
    }
    line
}

/// `key: value` (the value may be empty), the key a plain name.
fn split_key(line: &str) -> Option<(&str, &str)> {
    let (key, value) = match line.split_once(": ") {
        Some(kv) => kv,
        None => (line.strip_suffix(':')?, ""),
    };
    let key = key.trim();
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
    plain.then_some((key, value))
}

/// One scalar as PyYAML reads it; `None` for null.
fn scalar(line: usize, s: &str) -> Result<Option<toml::Value>> {
    use toml::Value as V;
    if let Some(inner) = s.strip_prefix('"') {
        let Some(inner) = inner.strip_suffix('"') else {
            bail!("line {line}: a quoted value that does not end on its line: {s}");
        };
        let mut out = String::new();
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(c @ ('"' | '\\' | '/')) => out.push(c),
                other => bail!(
                    "line {line}: the escape \\{} is not read here",
                    other.unwrap_or(' ')
                ),
            }
        }
        return Ok(Some(V::String(out)));
    }
    if let Some(inner) = s.strip_prefix('\'') {
        let Some(inner) = inner.strip_suffix('\'') else {
            bail!("line {line}: a quoted value that does not end on its line: {s}");
        };
        return Ok(Some(V::String(inner.replace("''", "'"))));
    }
    if s.starts_with(['|', '>', '&', '*', '!']) {
        bail!("line {line}: `{s}`: block strings, anchors and tags are not read; write the value on its line");
    }
    Ok(Some(match s {
        "null" | "Null" | "NULL" | "~" => return Ok(None),
        "true" | "True" | "TRUE" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => V::Boolean(true),
        "false" | "False" | "FALSE" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => {
            V::Boolean(false)
        }
        _ => {
            let digits = s.replace('_', "");
            if let Ok(i) = digits.parse::<i64>() {
                V::Integer(i)
            } else if let Some(f) = digits
                .parse::<f64>()
                .ok()
                .filter(|_| digits.chars().any(|c| c.is_ascii_digit()))
            {
                V::Float(f)
            } else {
                V::String(s.to_string())
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::{json_table, table};

    /// A TRL-style recipe: scalars of every kind, both list forms, comments, a null.
    #[test]
    fn a_flat_recipe_reads_as_its_settings() {
        let t = table(
            "# ORPO recipe\n---\nmodel_name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct\n\
             learning_rate: 8.0e-6   # peak\nmax_steps: -1\nbeta: 0.1\nnum_train_epochs: 1\n\
             use_rslora: yes\nbf16: true\nlr_scheduler_type: \"cosine\"\noutput_dir: 'runs/a #1'\n\
             lora_target_modules: [q_proj, v_proj]\ntarget_modules:\n  - k_proj\n  - o_proj\n\
             warmup_steps: null\nsave_steps: 1_000\nlearning_rate_e: 1e-4\n",
        )
        .unwrap();
        assert_eq!(
            t["model_name_or_path"].as_str(),
            Some("HuggingFaceTB/SmolLM2-135M-Instruct")
        );
        assert_eq!(t["learning_rate"].as_float(), Some(8e-6));
        assert_eq!(t["learning_rate_e"].as_float(), Some(1e-4));
        assert_eq!(t["max_steps"].as_integer(), Some(-1));
        assert_eq!(t["beta"].as_float(), Some(0.1));
        assert_eq!(t["use_rslora"].as_bool(), Some(true));
        assert_eq!(t["lr_scheduler_type"].as_str(), Some("cosine"));
        assert_eq!(t["output_dir"].as_str(), Some("runs/a #1"));
        assert_eq!(t["save_steps"].as_integer(), Some(1000));
        let list = |k: &str| -> Vec<String> {
            t[k].as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(list("lora_target_modules"), ["q_proj", "v_proj"]);
        assert_eq!(list("target_modules"), ["k_proj", "o_proj"]);
        assert!(!t.contains_key("warmup_steps"));
    }

    /// What lies past the flat subset is refused with its line, not guessed at.
    #[test]
    fn what_is_not_flat_is_refused_with_its_line() {
        for (text, want) in [
            (
                "a: 1\ndataset_mixer:\n  ultrafeedback: 1.0\n",
                "line 3: `dataset_mixer` holds a mapping",
            ),
            ("a: 1\nb: {c: 2}\n", "line 2: `b` holds a mapping"),
            ("a: 1\na: 2\n", "line 2: `a` is given twice"),
            ("a: 1\n---\nb: 2\n", "line 2: a second YAML document"),
            ("a: |\n  text\n", "line 1: `|`: block strings"),
            ("- a\n", "line 1: a list at the top"),
            ("a: [1, 2\n", "line 1: `a`'s list does not end"),
            ("just words\n", "line 1: `just words` is not `key: value`"),
            ("a: \"open\n", "line 1: a quoted value that does not end"),
        ] {
            let e = format!("{:#}", table(text).unwrap_err());
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    /// A JSON recipe: the same flat settings; a nested object refused.
    #[test]
    fn a_json_recipe_reads_as_its_settings() {
        let t = json_table(
            r#"{"max_steps": -1, "learning_rate": 5e-5, "use_rslora": true,
            "lora_target_modules": ["q_proj"], "warmup_steps": null}"#,
        )
        .unwrap();
        assert_eq!(t["max_steps"].as_integer(), Some(-1));
        assert_eq!(t["learning_rate"].as_float(), Some(5e-5));
        assert_eq!(t["use_rslora"].as_bool(), Some(true));
        assert_eq!(t["lora_target_modules"].as_array().map(Vec::len), Some(1));
        assert!(!t.contains_key("warmup_steps"));
        let e = json_table(r#"{"model_init_kwargs": {"torch_dtype": "bfloat16"}}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("`model_init_kwargs` holds a nested value"),
            "{e}"
        );
    }
}
