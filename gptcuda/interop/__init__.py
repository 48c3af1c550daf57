"""Checkpoints others can read and write: Hugging Face GPT-2 directories and llm.c model files.

Export (export.py) turns a run directory's checkpoint into

    hf    a directory GPT2LMHeadModel.from_pretrained() loads: config.json, model.safetensors (fp32, HF's
          names; Conv1D weights stored [in, out], so ours [out, in] are transposed; the head tied to wte
          and not stored, as save_pretrained does) and, for a gpt2 / bpe:N run, the tokenizer files
    llmc  llm.c's model file (train_gpt2.cu's gpt2_write_to_checkpoint): 256 int32 header [20240326,
          3 (fp32), maxT, V, L, H, C, Vp], then the 16 tensors of fill_in_parameter_sizes in that order,
          each stacked over the layers, Linear weights [out, in] like ours

Import (train.py / sample.py --init_from=...):

    named, overrides = load_init("hf:DIR" | "llmc:FILE" | RUN_DIR, cfg)

gives the parameters in our names and layouts (gptcuda/model/params.py) and the model settings the weights imply
(n_layer, n_head, n_embd, block_size, bias, vocab_size and, where the vocabulary is GPT-2's 50257, tokenizer
"gpt2"; a Hugging Face directory with a bpe:N export's tokenizer.json, "bpe:N": `load_weights` returns it). The model's vocabulary is cfg.vocab_size when set, else the rows the source stores (hf: the
tokenizer's; llmc: Vp; a run: its padded vocabulary) rounded up to cfg.vocab_multiple. Rows past the
source's are zero (padding: masked out of the loss and of sampling, and no gradient ever reaches them).

Every problem is an `InteropError` (a ValueError) whose message is one line naming the tensor or setting
and both values. Nothing here imports torch or transformers: safetensors' numpy API reads and writes.

Numerics match on both sides: layernorm eps 1e-5 (kernels/layernorm.cu, llm.c's layernorm.cuh, GPT-2's
layer_norm_epsilon), GELU tanh approximation (HF "gelu_new"), attention scaled by 1/sqrt(head size).

The package: common.py (InteropError, GPT-2's constants, check_expressible), hf.py (Hugging Face directories),
llmc.py (llm.c model files), run.py (load_run, export_run, latest_run), init.py (load_init, init_for_training).
Checkpoint files themselves are gptcuda/model/checkpoint.py's; training (init_from) and generation import
this package, and nothing here imports them.
"""
from __future__ import annotations

# the public API (__all__), plus what other modules import (_parse_spec, latest_run: sampler.py) and the
# formats' other constants
from gptcuda.interop.common import GPT2_EOT, GPT2_VOCAB, LN_EPS, InteropError, check_expressible  # noqa: F401
from gptcuda.interop.hf import (ENDOFTEXT, HF_ACTIVATIONS, from_hf, hf_config, hf_name_map, hf_tensors,
                                read_hf, write_hf)  # noqa: F401
from gptcuda.interop.init import Init, _parse_spec, init_for_training, load_init, load_weights, run_of  # noqa: F401
from gptcuda.interop.llmc import (LLMC_BF16, LLMC_FP32, LLMC_HEADER_INTS, LLMC_MAGIC, LLMC_ORDER,
                                  LLMC_VP_MULTIPLE, from_llmc, llmc_header, llmc_tensors, read_llmc,
                                  write_llmc)
from gptcuda.interop.run import Run, export_run, latest_run, load_run

__all__ = ["InteropError", "load_init", "init_for_training", "Init", "export_run", "load_run", "Run",
           "hf_tensors", "hf_config", "write_hf", "read_hf", "from_hf",
           "llmc_header", "llmc_tensors", "write_llmc", "read_llmc", "from_llmc",
           "LLMC_MAGIC", "LLMC_FP32", "LLMC_BF16", "LLMC_ORDER", "LN_EPS", "GPT2_EOT", "check_expressible"]
