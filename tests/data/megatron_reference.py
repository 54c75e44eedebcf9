#!/usr/bin/env python3
"""Checks switchyard's Megatron writer, `preprocess` and `tokenizer encode` against independent
Python (docs/data.md):

1. A Megatron indexed dataset written here from the format's description (stdlib `struct` only)
   is byte-identical to the one switchyard's MegatronWriter writes from the same documents
   (uint16 and int32 elements; empty documents and documents of several sequences included).
2. `switchyard tokenizer encode` gives the ids of Python's sentencepiece (python3-sentencepiece)
   on the same model and text, line by line.
3. `switchyard preprocess --append-eod` is byte-identical to a dataset written here from Python
   sentencepiece's ids of each non-empty line followed by the model's eos id.

Exit status 0 when all hold; the first difference is printed otherwise.
"""
import argparse
import os
import random
import shutil
import struct
import subprocess
import sys

import sentencepiece

# Element type codes of the .idx and their struct formats (Megatron's table, docs/data.md).
DTYPES = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}


def write_reference(prefix, documents, code):
    """documents: list of documents, each a list of sequences, each a list of ids."""
    fmt = "<" + DTYPES[code]
    size = struct.calcsize(fmt)
    lengths, pointers, doc_index = [], [], [0]
    offset = 0
    with open(prefix + ".bin", "wb") as bin_file:
        for doc in documents:
            for seq in doc:
                for token in seq:
                    bin_file.write(struct.pack(fmt, token))
                lengths.append(len(seq))
                pointers.append(offset)
                offset += len(seq) * size
            doc_index.append(len(lengths))
    with open(prefix + ".idx", "wb") as idx:
        idx.write(b"MMIDIDX\x00\x00")
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", code))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(doc_index)))
        idx.write(struct.pack("<%di" % len(lengths), *lengths))
        idx.write(struct.pack("<%dq" % len(pointers), *pointers))
        idx.write(struct.pack("<%dq" % len(doc_index), *doc_index))


def same_files(ours, reference, what):
    for suffix in (".bin", ".idx"):
        a = open(ours + suffix, "rb").read()
        b = open(reference + suffix, "rb").read()
        if a != b:
            where = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            print("%s: %s%s differs from the reference: %d vs %d bytes, first difference at byte %d"
                  % (what, ours, suffix, len(a), len(b), where))
            return False
    return True


def run(args):
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        print("command failed (%d): %s\n%s" % (result.returncode, " ".join(args), result.stderr))
        sys.exit(1)
    return result.stdout


def check_writer(work, tool):
    rng = random.Random(20240520)
    for code, vocab in ((8, 65535), (4, 200000)):
        documents = []
        for _ in range(300):
            sequences = rng.choice([1, 1, 1, 2, 3])
            documents.append([[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
                              for _ in range(sequences)])
        docs_path = os.path.join(work, "docs%d.txt" % code)
        with open(docs_path, "w") as f:
            for doc in documents:
                f.write("|".join(" ".join(map(str, seq)) for seq in doc) + "\n")
        ours = os.path.join(work, "ours%d" % code)
        ref = os.path.join(work, "ref%d" % code)
        run([tool, docs_path, ours, str(code)])
        write_reference(ref, documents, code)
        if not same_files(ours, ref, "writer, dtype code %d" % code):
            return False
    print("writer: byte-identical to the reference for uint16 and int32")
    return True


def corpus_text():
    rng = random.Random(7)
    words = ["expert", "router", "token", "rank", "gate", "naïve", "café", "Überweisung",
             "layer", "capacity", "all-to-all", "日本語", "ok?", "\"quoted\"", "x\ty"]
    lines = []
    for i in range(2000):
        if i % 97 == 0:
            lines.append("")  # empty documents are skipped by preprocess
        else:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randrange(1, 25))))
    return "\n".join(lines) + "\n"


def check_tokenizer_and_preprocess(work, switchyard):
    text_path = os.path.join(work, "corpus.txt")
    with open(text_path, "w", encoding="utf-8") as f:
        f.write(corpus_text())
    model_prefix = os.path.join(work, "tok")
    run([switchyard, "tokenizer", "train", "--input", text_path, "--vocab-size", "150",
         "--model-type", "bpe", "--out", model_prefix])
    sp = sentencepiece.SentencePieceProcessor(model_file=model_prefix + ".model")
    lines = open(text_path, encoding="utf-8").read().split("\n")[:-1]

    ids_path = os.path.join(work, "ids.txt")
    run([switchyard, "tokenizer", "encode", "--model", model_prefix + ".model", "--input",
         text_path, "--out", ids_path])
    ours = open(ids_path, encoding="utf-8").read().split("\n")[:-1]
    if len(ours) != len(lines):
        print("encode: %d lines of ids for %d lines of text" % (len(ours), len(lines)))
        return False
    for n, (line, got) in enumerate(zip(lines, ours)):
        expected = " ".join(map(str, sp.encode(line)))
        if got != expected:
            print("encode: line %d %r: switchyard %s, python sentencepiece %s"
                  % (n + 1, line, got, expected))
            return False
    print("tokenizer encode: equal to python sentencepiece on %d lines" % len(lines))

    out = os.path.join(work, "pre")
    run([switchyard, "preprocess", "--input", text_path, "--tokenizer", model_prefix + ".model",
         "--out", out, "--append-eod", "--workers", "2", "--quiet"])
    documents = [[sp.encode(line) + [sp.eos_id()]] for line in lines if line]
    ref = os.path.join(work, "pre_ref")
    write_reference(ref, documents, 8)
    if not same_files(out, ref, "preprocess"):
        return False
    print("preprocess: byte-identical to python sentencepiece + the reference writer "
          "(%d documents)" % len(documents))
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--switchyard", required=True)
    parser.add_argument("--write-tool", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    ok = check_writer(args.workdir, args.write_tool) and \
        check_tokenizer_and_preprocess(args.workdir, args.switchyard)
    if ok:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
