"""Small Parquet files in the layouts the Hugging Face Hub serves, for tests/data_formats.rs and
tests/corpus_data.rs: written to tests/fixtures/data/.

  h4_snappy.parquet      the H4 UltraFeedback layout (prompt string, chosen/rejected message
                         lists with the user turn, prompt_id, messages, score_*), snappy pages
  h4_zstd.parquet        the same rows, zstd pages
  text_gzip.parquet      {prompt, chosen, rejected} strings, gzip pages
  alpaca.parquet         {instruction, input, output} SFT rows
  bad_rows.parquet       row 2 has a null chosen, row 3 an empty prompt
  bad_types.parquet      chosen is an integer column

    /tmp/venv-trl/bin/python scripts/make_parquet_fixtures.py   (needs pyarrow)
"""

import os

import pyarrow as pa
import pyarrow.parquet as pq

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "data")


def msg(role, content):
    return {"role": role, "content": content}


def h4_rows():
    rows = []
    for i, (q, good, bad) in enumerate(
        [
            ("What is the capital of France?", "Paris.", "Rome."),
            ("What is 2+2?", "4", "5"),
            ("What is 7 plus 8?", "It is 15.", "It is 16."),
        ]
    ):
        rows.append(
            {
                "prompt": q,
                "prompt_id": f"id{i}",
                "chosen": [msg("user", q), msg("assistant", good)],
                "rejected": [msg("user", q), msg("assistant", bad)],
                "messages": [msg("user", q), msg("assistant", good)],
                "score_chosen": 8.5,
                "score_rejected": 3.0,
            }
        )
    return rows


def write(name, rows, compression, schema=None):
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, os.path.join(OUT, name), compression=compression)


def main():
    os.makedirs(OUT, exist_ok=True)
    write("h4_snappy.parquet", h4_rows(), "snappy")
    write("h4_zstd.parquet", h4_rows(), "zstd")
    text = [
        {"prompt": "Q: What is the capital of France?\nA:", "chosen": " Paris.", "rejected": " Rome."},
        {"prompt": "Q: What is 2+2?\nA:", "chosen": " 4", "rejected": " 5"},
    ]
    write("text_gzip.parquet", text, "gzip")
    alpaca = [
        {"instruction": "Name the capital of France.", "input": "", "output": "Paris."},
        {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"},
    ]
    write("alpaca.parquet", alpaca, "snappy")
    bad = [
        {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5"},
        {"prompt": "What is 2+3?", "chosen": None, "rejected": " 6"},
        {"prompt": "", "chosen": " 7", "rejected": " 8"},
    ]
    schema = pa.schema([("prompt", pa.string()), ("chosen", pa.string()), ("rejected", pa.string())])
    write("bad_rows.parquet", bad, "snappy", schema)
    write("bad_types.parquet", [{"prompt": "What is 2+2?", "chosen": 4, "rejected": " 5"}], "snappy")
    # A NaN weight (JSON has no NaN: it must be a row error, not the default weight) and a
    # decimal weight column (a number, as pandas writes decimal.Decimal values).
    weighted = [
        {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5", "weight": 2.0},
        {"prompt": "What is 2+3?", "chosen": " 5", "rejected": " 6", "weight": float("nan")},
    ]
    schema = pa.schema([("prompt", pa.string()), ("chosen", pa.string()), ("rejected", pa.string()), ("weight", pa.float64())])
    write("nan_weight.parquet", weighted, "snappy", schema)
    import decimal
    dec = [
        {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5", "weight": decimal.Decimal("2.50")},
    ]
    schema = pa.schema([("prompt", pa.string()), ("chosen", pa.string()), ("rejected", pa.string()), ("weight", pa.decimal128(5, 2))])
    write("decimal_weight.parquet", dec, "snappy", schema)


if __name__ == "__main__":
    main()
