"""Token ids of TRL 1.16's own ORPOTrainer, DPOTrainer and SFTTrainer for a few rows, written to
tests/fixtures/trl_ids/ for tests/trl_ids.rs, which asserts that lorafit's `tokenization = "trl"`
gives the same ids.

Two small byte-level BPE tokenizers are trained here and committed beside the ids, so the test
always runs:
  chatml/  no post-processor; BOS <|im_start|>, EOS <|im_end|>; SmolLM2's ChatML chat template
           (responses end `<|im_end|>\\n`)
  llama/   a post-processor that prepends <s>; BOS <s>, EOS </s>, add_bos_token; a Zephyr-style
           template whose turns end `</s>\\n`
Each row goes through TRL's code itself: `maybe_extract_prompt` + `maybe_apply_chat_template` +
`ORPOTrainer.tokenize_row` (with `build_tokenized_answer`), and `DPOTrainer._prepare_dataset` /
`SFTTrainer._prepare_dataset`, on objects that carry only what those functions read.

    python3 -m venv /tmp/venv-trl && /tmp/venv-trl/bin/pip install trl==1.16.0 transformers torch
    /tmp/venv-trl/bin/python scripts/make_trl_ids_fixture.py
"""

import json
import os
import sys
import tempfile
import types

import trl
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt
from trl.experimental.orpo import ORPOTrainer

assert trl.__version__ == "1.16.0", trl.__version__

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "trl_ids")
CHATML = open(os.path.join(ROOT, "tests", "fixtures", "smollm2_chat_template.jinja")).read()
ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS = [
    "Q: What is the capital of France? A: Paris. The capital of Italy is Rome.",
    "What is 2+2? The answer is 4. What is 7 plus 8? It is 15, not 16.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "Paris Paris Paris Rome Rome Rome Berlin Madrid capital country city answer question",
    "Sure! Here is the answer: Paris is the capital of France. No, it is Lyon.",
    "system user assistant Be brief. Hello there! Hi! How are you? I am fine, thanks.",
]


def train_tokenizer(specials, bos_post):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    if bos_post:
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(name, tok, config):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return PreTrainedTokenizerFast.from_pretrained(d)


def orpo_ids(tokenizer, row):
    """ORPOTrainer's preprocessing of one row, through TRL's own functions."""
    row = maybe_extract_prompt(dict(row))
    row = maybe_apply_chat_template(row, tokenizer)
    fake = types.SimpleNamespace(processing_class=tokenizer, is_encoder_decoder=False, max_length=10**9)
    fake.build_tokenized_answer = lambda p, a: ORPOTrainer.build_tokenized_answer(fake, p, a)
    batch = ORPOTrainer.tokenize_row(fake, row)
    out = {}
    for k in ("chosen", "rejected"):
        ids, labels = batch[f"{k}_input_ids"], batch[f"{k}_labels"]
        n = sum(1 for x in labels if x == -100)
        out[k] = {"prompt": ids[:n], "response": ids[n:]}
    return out


def prepare(trainer_cls, config, tokenizer, rows, **kw):
    fake = types.SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=True)
    ds = Dataset.from_list(rows)
    return trainer_cls._prepare_dataset(fake, ds, tokenizer, config, dataset_name="fixture", **kw)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        chatml_tok = train_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos_post=False)
        chatml = write_tokenizer(
            "chatml",
            chatml_tok,
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHATML,
            },
        )
        llama_tok = train_tokenizer(["<unk>", "<s>", "</s>"], bos_post=True)
        llama = write_tokenizer(
            "llama",
            llama_tok,
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "</s>",
                "add_bos_token": True,
                "chat_template": ZEPHYR,
            },
        )
        user = lambda c: {"role": "user", "content": c}
        asst = lambda c: {"role": "assistant", "content": c}
        text_rows = [
            # Plain: the boundary falls between pre-tokens.
            {"prompt": "Q: What is the capital of France?\nA:", "chosen": " Paris.", "rejected": " Rome."},
            # The prompt ends with a space: " Paris" merges across the boundary in both.
            {"prompt": "Q: What is the capital of France? A: ", "chosen": "Paris.", "rejected": "Rome."},
            # A merge in chosen only: the responses split the prompt differently.
            {"prompt": "Q: What is the capital of France? A: ", "chosen": "Paris.", "rejected": "\nRome."},
            # Responses that already end with EOS text.
            {"prompt": "What is 2+2?", "chosen": " 4.<|im_end|>", "rejected": " 5.</s>"},
        ]
        chat_rows = [
            {"prompt": [user("What is the capital of France?")], "chosen": [asst("Paris.")], "rejected": [asst("Rome.")]},
            {
                "prompt": [{"role": "system", "content": "Be brief."}, user("Hi!"), asst("Hello there!"), user("What is 7 plus 8?")],
                "chosen": [asst("It is 15.")],
                "rejected": [asst("It is 16, not 15.")],
            },
        ]
        # Implicit prompt (whole conversations): a dataset of its own, as TRL extracts prompts only
        # when the first row has none.
        implicit_rows = [{"chosen": [user("What is 2+2?"), asst("4")], "rejected": [user("What is 2+2?"), asst("5")]}]
        sft_rows = [
            {"prompt": "Q: What is the capital of France? A: ", "completion": "Paris."},
            {"prompt": "What is 2+2?", "completion": " 4."},
        ]
        sft_chat_rows = [{"prompt": [user("What is 2+2?")], "completion": [asst("The answer is 4.")]}]

        cases = []
        for tok_name, tok in (("chatml", chatml), ("llama", llama)):
            for kind, rows in (("text", text_rows), ("chat", chat_rows), ("chat", implicit_rows)):
                dpo = prepare(DPOTrainer, DPOConfig(output_dir=tmp, max_length=None, dataset_num_proc=None, bf16=False, use_cpu=True), tok, rows)
                for row, d in zip(rows, dpo):
                    cases.append(
                        {
                            "tokenizer": tok_name,
                            "kind": kind,
                            "row": row,
                            "orpo": orpo_ids(tok, row),
                            "dpo": {"prompt": d["prompt_ids"], "chosen": d["chosen_ids"], "rejected": d["rejected_ids"]},
                        }
                    )
            for kind, rows in (("text", sft_rows), ("chat", sft_chat_rows)):
                cfg = SFTConfig(
                    output_dir=tmp, max_length=None, dataset_num_proc=None, completion_only_loss=True, bf16=False, use_cpu=True
                )
                sft = prepare(SFTTrainer, cfg, tok, rows, packing=False, formatting_func=None)
                for row, s in zip(rows, sft):
                    n = next(i for i, x in enumerate(s["labels"]) if x != -100)
                    cases.append(
                        {
                            "tokenizer": tok_name,
                            "kind": kind,
                            "row": row,
                            "sft": {"prompt": s["input_ids"][:n], "completion": s["input_ids"][n:]},
                        }
                    )
        with open(os.path.join(OUT, "cases.json"), "w") as f:
            json.dump({"trl": trl.__version__, "cases": cases}, f, indent=1)
        print(f"{len(cases)} cases written to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
