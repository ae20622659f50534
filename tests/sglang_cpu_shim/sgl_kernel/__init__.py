"""Stand-in for `sgl_kernel` (SGLang's compiled kernels) in the CPU test lane only.

The registry has no CPU build of `sglang-kernel`; SGLang's CPU code path (SGLANG_USE_CPU_ENGINE=1)
imports a few `*_cpu` names from it at module import time. Each is used only by a feature that
Tether's CPU lane never turns on, so each stand-in raises if it is ever called: a test that passes
with this shim on the path proves that none of them ran.

    copy_all_layer_kv_cache_cpu              mem_cache/cache_move: KV copies between cache slots
                                             (HiCache / hierarchical cache moves; off here)
    assign_req_to_token_pool_cpu             mem_cache/allocation: speculative-decoding slot
                                             allocation (alloc_for_spec_decode; no speculation here)
    assign_extend_cache_locs_cpu             speculative/cache_locs: draft-model cache locations
    assign_draft_cache_locs_contiguous_cpu   speculative/cache_locs: draft-model cache locations
    build_tree_kernel_efficient_cpu          speculative/spec_tree: EAGLE draft tree
    verify_tree_greedy_cpu                   speculative/spec_tree: EAGLE tree verification
    fill_bonus_tokens_cpu                    speculative/eagle: EAGLE bonus tokens
    fill_accept_out_cache_loc_cpu            speculative/eagle: EAGLE accepted-token cache slots

It lives under tests/ and is put on PYTHONPATH only by the CPU SGLang lane of test.sh; on a GPU
machine the real `sglang-kernel` wheel (the `sglang` extra) provides `sgl_kernel` instead.
"""

__version__ = "0.0.0+tether-cpu-shim"

_NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
)


def _never_called(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called: Tether's CPU shim has no implementation of it "
            "(tests/sglang_cpu_shim); a feature the CPU lane does not support is turned on")

    stub.__name__ = name
    return stub


for _name in _NAMES:
    globals()[_name] = _never_called(_name)
