//! The library's messages as the job server shows them. The trainer, eval and export share their
//! checks and errors with the command line, whose advice names its flags (`--resume DIR`,
//! `--overwrite`, `--data FILE.jsonl`); a job's settings are JSON fields and its resume is a
//! route, so that advice is reworded here before a job's failure or a refused submission shows
//! it. The tests build each message with the library's own code, so that a change of its wording
//! shows up here.

/// The command line's advice that has other words in the API, longest phrases first.
const REWORDED: &[(&str, &str)] = &[
    (
        "start it again with --overwrite",
        "start it again with `\"overwrite\": true`",
    ),
    ("(`valid`, --valid FILE.jsonl)", "(`valid`)"),
    (
        "set `data` in the config or pass --data FILE.jsonl",
        "set `data`",
    ),
    ("(--output DIR)", "(`output`)"),
    ("(--output)", "(`output`)"),
    ("(--data)", "(`data`)"),
    ("pass --model PATH", "set `model`"),
    ("(--device cpu)", "(`\"device\": \"cpu\"`)"),
    ("--overwrite (overwrite = true)", "`\"overwrite\": true`"),
    ("--resume ", "resuming from "),
    ("--warm-start ", "`warm_start` "),
    ("--format ", "format "),
];

/// The advice of a new run into a folder that holds one: `pass --resume DIR to continue it, or
/// --overwrite (overwrite = true) to delete it and start again` (`run_folder::prepare`). A job
/// continues only its own run (`POST /jobs/{id}/resume`), so the API's ways out are another
/// folder or `overwrite`.
const HOLDS_RUN_HEAD: &str = "pass --resume ";
const HOLDS_RUN_TAIL: &str =
    " to continue it, or --overwrite (overwrite = true) to delete it and start again";
const HOLDS_RUN_API: &str =
    "name another `output`, or set `\"overwrite\": true` to delete it and start again";

/// `message` with the command line's advice in the API's words.
pub fn api_wording(message: &str) -> String {
    let mut text = message.to_string();
    if let Some(start) = text.find(HOLDS_RUN_HEAD) {
        if let Some(len) = text[start..].find(HOLDS_RUN_TAIL) {
            text.replace_range(start..start + len + HOLDS_RUN_TAIL.len(), HOLDS_RUN_API);
        }
    }
    for (cli, api) in REWORDED {
        text = text.replace(cli, api);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;
    use crate::train::run_folder;

    /// No flag of the command line is left: `--` followed by a letter.
    fn names_no_flag(text: &str) -> bool {
        !text
            .match_indices("--")
            .any(|(at, _)| text[at + 2..].starts_with(|c: char| c.is_ascii_lowercase()))
    }

    #[test]
    fn the_trainers_advice_names_the_apis_fields() {
        let dir = std::env::temp_dir().join(format!("lorafit-wording-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("adapter")).unwrap();
        std::fs::write(dir.join("plan.toml"), "").unwrap();

        let holds = run_folder::prepare(&dir, None, false).unwrap_err();
        let cli = format!("{holds:#}");
        assert!(cli.contains("--overwrite"), "{cli}");
        let api = api_wording(&cli);
        assert!(names_no_flag(&api), "{api}");
        assert!(
            api.contains("already holds a run (adapter, plan.toml)")
                && api.contains("name another `output`, or set `\"overwrite\": true`"),
            "{api}"
        );

        let empty = dir.join("adapter");
        for e in [
            run_folder::find_checkpoint(&dir.join("missing")).unwrap_err(),
            run_folder::find_checkpoint(&empty).unwrap_err(),
        ] {
            let api = api_wording(&format!("{e:#}"));
            assert!(names_no_flag(&api), "{api}");
            assert!(api.starts_with("resuming from "), "{api}");
        }

        let cfg = TrainConfig {
            data: "train.jsonl".into(),
            output: " ".into(),
            ..TrainConfig::default()
        };
        let api = api_wording(&format!("{:#}", cfg.validate().unwrap_err()));
        assert!(names_no_flag(&api) && api.contains("(`output`)"), "{api}");

        let eval = crate::eval::EvalOptions::default();
        let api = api_wording(&eval.validate().unwrap_err().to_string());
        assert!(names_no_flag(&api) && api.contains("(`data`)"), "{api}");
        // A device that is not there (on a machine without a GPU, CUDA's).
        for device in ["tpu", "cuda:99"] {
            let e = crate::tensor::Device::check(device).unwrap_err();
            let api = api_wording(&format!("{e:#}"));
            assert!(names_no_flag(&api), "{api}");
        }
        // Text without advice is left as it is.
        assert_eq!(api_wording("bad.jsonl:2: missing"), "bad.jsonl:2: missing");
    }
}
