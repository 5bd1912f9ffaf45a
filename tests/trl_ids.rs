//! lorafit's `tokenization = "trl"` gives TRL 1.16's own token ids: ORPOTrainer's `tokenize_row`
//! for ORPO, DPOTrainer's and SFTTrainer's `tokenize_fn` for DPO and SFT, on string and chat rows,
//! with two tokenizers (ChatML without a post-processor; a BOS-adding post-processor with a
//! Zephyr-style template). The ids were made by TRL itself (scripts/make_trl_ids_fixture.py) and
//! are committed with the tokenizers in tests/fixtures/trl_ids/.

mod common;
use lorafit::data::dataset::{parse_row, DatasetKind, Example};
use lorafit::data::{
    tokenize_pair, tokenize_sft_example, ChatTemplate, TextTokenizer, TokenRules, TokenizeOptions,
    TokenizeReport,
};
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

struct Tok {
    tok: TextTokenizer,
    template: ChatTemplate,
}

fn load(name: &str) -> Tok {
    let dir = common::fixture(&format!("trl_ids/{name}"));
    Tok {
        tok: TextTokenizer::from_file(dir.join("tokenizer.json")).unwrap(),
        template: ChatTemplate::from_tokenizer_config(dir.join("tokenizer_config.json"))
            .unwrap()
            .expect("the fixture's tokenizer_config.json has a chat template"),
    }
}

/// Limits no fixture row reaches: TRL ran without truncation.
fn opts(rules: TokenRules) -> TokenizeOptions {
    TokenizeOptions::new(1 << 20, 1 << 19).with_rules(rules)
}

#[test]
fn trl_ids_equal_trl_1_16() {
    let text = std::fs::read_to_string(common::fixture("trl_ids/cases.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(fixture["trl"], "1.16.0");
    let toks = [("chatml", load("chatml")), ("llama", load("llama"))];
    let (mut orpo_rows, mut dpo_rows, mut sft_rows) = (0, 0, 0);
    let (mut merges, mut splits, mut double_eos) = (0, 0, 0);
    for (i, case) in fixture["cases"].as_array().unwrap().iter().enumerate() {
        let name = case["tokenizer"].as_str().unwrap();
        let t = &toks.iter().find(|(n, _)| *n == name).unwrap().1;
        let what = format!("case {i} ({name}, {}): {}", case["kind"], case["row"]);
        if let Some(sft) = case.get("sft") {
            let Example::Sft { data, .. } =
                parse_row(&case["row"], DatasetKind::Sft, i + 1).unwrap()
            else {
                panic!("{what}: not an SFT row")
            };
            let mut rep = TokenizeReport::default();
            let got = tokenize_sft_example(
                &data,
                &t.tok,
                Some(&t.template),
                &opts(TokenRules::TrlDpo),
                &mut rep,
            )
            .unwrap();
            assert_eq!(got.prompt, ids(&sft["prompt"]), "{what}: SFT prompt");
            assert_eq!(
                got.completion,
                ids(&sft["completion"]),
                "{what}: SFT completion"
            );
            sft_rows += 1;
            continue;
        }
        let Example::Preference { data, .. } =
            parse_row(&case["row"], DatasetKind::Preference, i + 1).unwrap()
        else {
            panic!("{what}: not a preference row")
        };

        // DPOTrainer: one prompt, two responses.
        let mut rep = TokenizeReport::default();
        let dpo = &case["dpo"];
        let got = tokenize_pair(
            &data,
            &t.tok,
            Some(&t.template),
            &opts(TokenRules::TrlDpo),
            &mut rep,
        )
        .unwrap();
        assert_eq!(got.prompt, ids(&dpo["prompt"]), "{what}: DPO prompt");
        assert_eq!(got.chosen, ids(&dpo["chosen"]), "{what}: DPO chosen");
        assert_eq!(got.rejected, ids(&dpo["rejected"]), "{what}: DPO rejected");
        dpo_rows += 1;

        // ORPOTrainer: each response has its own prompt ids.
        let mut rep = TokenizeReport::default();
        let orpo = &case["orpo"];
        let got = tokenize_pair(
            &data,
            &t.tok,
            Some(&t.template),
            &opts(TokenRules::TrlOrpo),
            &mut rep,
        )
        .unwrap();
        let (pc, rc) = (
            ids(&orpo["chosen"]["prompt"]),
            ids(&orpo["chosen"]["response"]),
        );
        let (pr, rr) = (
            ids(&orpo["rejected"]["prompt"]),
            ids(&orpo["rejected"]["response"]),
        );
        if pc == pr {
            assert_eq!(got.prompt, pc, "{what}: ORPO prompt");
            assert_eq!(got.chosen, rc, "{what}: ORPO chosen");
            assert_eq!(got.rejected, rr, "{what}: ORPO rejected");
            assert_eq!(rep.split_prompts, 0, "{what}");
        } else {
            // The responses split the prompt differently (a merge in one of them): the sequences
            // are TRL's, the prompt is their shared ids, and each prompt's rest starts its
            // response (README, "Tokenization").
            assert_eq!(
                got.chosen_sequence(),
                [pc.clone(), rc].concat(),
                "{what}: ORPO chosen sequence"
            );
            assert_eq!(
                [got.prompt.clone(), got.rejected.clone()].concat(),
                [pr.clone(), rr].concat(),
                "{what}: ORPO rejected sequence"
            );
            let shared = pc.iter().zip(&pr).take_while(|(a, b)| a == b).count();
            assert_eq!(got.prompt, pc[..shared], "{what}: ORPO shared prompt");
            assert_eq!(rep.split_prompts, 1, "{what}");
            splits += 1;
        }
        merges += rep.boundary_merges;
        let eos = t.tok.eos_id().unwrap();
        let newline = t.tok.encode("\n").unwrap();
        if got
            .chosen
            .ends_with(&[&[eos][..], &newline, &[eos]].concat())
        {
            double_eos += 1;
        }
        orpo_rows += 1;
    }
    // The fixture covers what the rules are about.
    assert_eq!((orpo_rows, dpo_rows, sft_rows), (14, 14, 6));
    assert!(merges >= 4, "boundary merges: {merges}");
    assert_eq!(
        splits, 2,
        "rows whose responses split the prompt differently"
    );
    assert!(
        double_eos >= 4,
        "chat responses given a second EOS after `EOS\\n`: {double_eos}"
    );
}

#[test]
fn trl_orpo_adds_bos_whatever_add_bos_token_says() {
    // The ChatML tokenizer has add_bos_token = false and BOS <|im_start|>: TRL's ORPOTrainer still
    // puts <|im_start|> in front of a text prompt, and appends <|im_end|> to each response.
    let t = load("chatml");
    assert!(!t.tok.add_bos());
    let Example::Preference { data, .. } = parse_row(
        &serde_json::json!({"prompt": "What is 2+2?", "chosen": " 4.", "rejected": " 5."}),
        DatasetKind::Preference,
        1,
    )
    .unwrap() else {
        panic!()
    };
    let mut rep = TokenizeReport::default();
    let trl = tokenize_pair(&data, &t.tok, None, &opts(TokenRules::TrlOrpo), &mut rep).unwrap();
    let bos = t.tok.bos_id().unwrap();
    let eos = t.tok.eos_id().unwrap();
    assert_eq!(trl.prompt[0], bos);
    assert_eq!(
        &trl.prompt[1..],
        t.tok.encode("What is 2+2?").unwrap().as_slice()
    );
    assert_eq!(*trl.chosen.last().unwrap(), eos);
    // `separate` follows add_bos_token: no BOS here.
    let sep = tokenize_pair(&data, &t.tok, None, &opts(TokenRules::Separate), &mut rep).unwrap();
    assert_eq!(sep.prompt, t.tok.encode("What is 2+2?").unwrap());
    assert_eq!(sep.chosen, trl.chosen);
}
