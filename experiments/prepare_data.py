"""Turn a folder of text files into token shards for ``experiments.train --data OUT``.

    python -m experiments.prepare_data TEXT_DIR OUT_DIR                  # byte-level
    python -m experiments.prepare_data TEXT_DIR OUT_DIR --tokenizer bpe --vocab-size 4096

Files are read in sorted path order; every ``--heldout-every``-th document goes to the
held-out split. The BPE tokenizer is trained here, on the first ``--bpe-sample-mb`` of
text, and stored with the shards. Bad input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

from moejax.data.corpus import EMBEDDED, stdlib_documents, text_folder_documents
from moejax.data.shards import DataError, write_shards
from moejax.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.prepare_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help=f"folder of text files, or '{EMBEDDED}' for the stdlib corpus")
    p.add_argument("out", type=pathlib.Path, help="shard folder to create")
    p.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (> 256)")
    p.add_argument("--bpe-sample-mb", type=float, default=4.0,
                   help="megabytes of text the BPE merges are learnt from")
    p.add_argument("--suffixes", default=".txt,.md,.py,.rst",
                   help="comma-separated file endings to read")
    p.add_argument("--heldout-every", type=int, default=50,
                   help="every N-th document is held out (0: none)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT folder (kept if the build fails)")
    return p.parse_args(argv)


def _documents(args: argparse.Namespace):
    if args.source == EMBEDDED:
        return stdlib_documents()
    suffixes = tuple(s.strip() for s in args.suffixes.split(",") if s.strip())
    return text_folder_documents(pathlib.Path(args.source), suffixes)


def _bpe_sample(docs, megabytes: float):
    budget = int(megabytes * 1e6)
    for doc in docs:
        if budget <= 0:
            return
        budget -= len(doc)
        yield doc


def _refuse_out_over_source(args: argparse.Namespace) -> None:
    """OUT must not be the source folder or hold it: replacing OUT would delete the text."""
    if args.source == EMBEDDED:
        return
    source, out = pathlib.Path(args.source).resolve(), args.out.resolve()
    if out == source or out in source.parents:
        raise DataError(f"OUT {args.out} is or holds the source folder {args.source}; "
                        "write the shards somewhere else")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.heldout_every < 0:
            raise DataError(f"--heldout-every={args.heldout_every}: must be >= 0")
        if args.out.exists() and not args.overwrite:
            raise DataError(f"{args.out} already exists; pass --overwrite to replace it")
        _refuse_out_over_source(args)
        if args.bpe_sample_mb <= 0:
            raise DataError(f"--bpe-sample-mb={args.bpe_sample_mb}: must be > 0")
        docs = _documents(args)
        tokenizer: Tokenizer = ByteTokenizer()
        if args.tokenizer == "bpe":
            if args.vocab_size <= 256:
                raise DataError(f"--vocab-size={args.vocab_size}: BPE needs more than 256")
            docs, sample = itertools.tee(docs)
            print(f"training BPE ({args.vocab_size} ids) on {args.bpe_sample_mb} MB ...")
            tokenizer = BPETokenizer.train(_bpe_sample(sample, args.bpe_sample_mb),
                                           args.vocab_size)
        info = write_shards(docs, args.out, tokenizer, source=str(args.source),
                            heldout_every=args.heldout_every, replace=args.overwrite)
    except (DataError, OSError) as e:  # OSError: an OUT that cannot be made, e.g. under a file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {info.source_bytes / 1e6:.2f} MB of text -> "
          f"{info.tokens['train']:,} train tokens ({info.documents['train']} documents), "
          f"{info.tokens['val']:,} held-out tokens ({info.documents['val']} documents); "
          f"{info.tokenizer} tokenizer, vocab {info.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
