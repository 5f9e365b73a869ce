"""Write a tiny llama-architecture GGUF model for starting llama-server without real weights.

    python benchmarks/tiny_model.py OUT.gguf [--vocab PATH]

llama-server needs a loadable model even for POST /apply-template, which never runs it.
This writes one layer of 64-wide random weights (~17 MB) around the tokenizer metadata of a
vocab GGUF from the pinned tree (by default `models/ggml-vocab-llama-spm.gguf`, the tokenizer
the reference recordings were made with: see ../shared/reference/README.md). The weights are
noise; the model is for timing llama-server's request handling (`llamaprompt bench
--llama-server BIN OUT.gguf`), not for generating text. Written with the gguf package.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# the model's shape: small enough to load in a few ms, valid for llama.cpp's llama loader
N_EMBD, N_FF, N_HEAD, N_LAYER, N_CTX = 64, 128, 2, 1, 4096
ARCH_KEYS = {  # hyperparameters replaced in the vocab file's metadata
    "llama.block_count": N_LAYER,
    "llama.context_length": N_CTX,
    "llama.embedding_length": N_EMBD,
    "llama.feed_forward_length": N_FF,
    "llama.attention.head_count": N_HEAD,
    "llama.attention.head_count_kv": N_HEAD,
    "llama.rope.dimension_count": N_EMBD // N_HEAD,
}


def default_vocab() -> Path:
    """The llama-spm vocab GGUF of the llama.cpp tree the package was built from (found as the
    tests find it). Raises FileNotFoundError when that tree is not on this machine."""
    from conftest import llama_cpp_models_dir

    models = llama_cpp_models_dir()
    path = models / "ggml-vocab-llama-spm.gguf" if models else None
    if path is None or not path.exists():
        raise FileNotFoundError("ggml-vocab-llama-spm.gguf not found: pass --vocab PATH (models/ of a llama.cpp tree)")
    return path


def write_tiny_model(out: Path, vocab: Path, seed: int = 0) -> Path:
    """Copy ``vocab``'s metadata (tokenizer, template if any) into ``out`` with tiny llama
    hyperparameters and random F32 weights. Returns ``out``. Raises ValueError when ``vocab``
    is not a llama-architecture GGUF (or not a GGUF file: the gguf package's reader says why),
    OSError when a file cannot be read or written."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(vocab))
        arch = reader.fields["general.architecture"].contents()
    except (ValueError, KeyError, IndexError) as e:  # what the reader raises for a bad file
        raise ValueError(f"{vocab}: not a readable GGUF vocab file ({e})") from None
    if arch != "llama":
        raise ValueError(f"{vocab}: architecture {arch!r}, expected 'llama'")
    writer = gguf.GGUFWriter(str(out), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in ARCH_KEYS:
            writer.add_uint32(key, ARCH_KEYS[key])
            continue
        if key == "general.file_type":
            writer.add_uint32(key, int(gguf.LlamaFileType.ALL_F32))
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", np.ones(N_EMBD, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(blk + name + ".weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(blk + "ffn_norm.weight", np.ones(N_EMBD, np.float32))
        writer.add_tensor(blk + "ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(blk + "ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(blk + "ffn_down.weight", weights(N_EMBD, N_FF))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the GGUF file to write")
    ap.add_argument(
        "--vocab",
        type=Path,
        default=None,
        help="a llama-architecture vocab GGUF (default: the pinned tree's llama-spm)",
    )
    args = ap.parse_args()
    if args.out.is_dir() or not os.access(args.out.parent.resolve(), os.W_OK):
        ap.error(f"{args.out}: cannot write a file there")
    try:
        vocab = args.vocab or default_vocab()
        if not vocab.is_file():
            ap.error(f"{vocab}: no such file")
        out = write_tiny_model(args.out, vocab)
    except FileNotFoundError as e:
        ap.error(str(e))
    except ValueError as e:  # not a GGUF file, a truncated one, another architecture
        ap.error(str(e))
    except OSError as e:
        ap.error(f"{e.filename or args.out}: {e.strerror or e}")
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
