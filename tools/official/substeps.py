"""Where the official-vs-ours attention gap is born: prefill, step by step (q, kv for every layer; the sparse
attention core and the output projections for the window-only layers). Ours in the release's KV form, or
SUBSTEPS_KV=fp8 | bf16 to force one; the official side always runs as released (OFFICIAL_DIR, check_modules.py)."""
import os, sys
import torch
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_modules as o22  # noqa: E402
om = o22.om


def main():
    kv = os.environ.get("SUBSTEPS_KV")
    kv_qat = None if not kv else kv == "fp8"
    for backend in ("torch", "triton"):
        ids, toks, rec = o22.ours(backend, kv_qat=kv_qat)
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
        with torch.inference_mode():
            m = o22.official_model()
            for L in range(len(m.layers)):
                a = m.layers[L].attn
                x = rec[f"layers.{L}.attn.in"][None].cuda()
                S = x.size(1)
                rd = a.rope_head_dim
                fc = a.freqs_cis[:S]
                q = a.q_norm(a.wq_a(x))
                q = a.wq_b(q).unflatten(-1, (a.n_local_heads, a.head_dim))
                q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + a.eps)
                om.apply_rotary_emb(q[..., -rd:], fc)
                kv = a.kv_norm(a.wkv(x))
                om.apply_rotary_emb(kv[..., -rd:], fc)
                om.act_quant(kv[..., :-rd], 64, om.scale_fmt, om.scale_dtype, True)
                our_q = rec[f"layers.{L}.attn.q"][None].cuda()
                our_kv = rec[f"layers.{L}.attn.kv"][None].cuda()
                p = f"{backend} L{L}"
                print(p, "q", o22.rel(our_q, q), "kv", o22.rel(our_kv[:, :S], kv), "kv shape", tuple(our_kv.shape))
                if a.compress_ratio:
                    continue
                idx = om.get_window_topk_idxs(a.window_size, 1, S, 0).int()
                core = om.sparse_attn(q, kv, a.attn_sink, idx, a.softmax_scale)
                om.apply_rotary_emb(core[..., -rd:], fc, True)
                core_ours_in = om.sparse_attn(our_q.contiguous(), our_kv[:, :S].contiguous(), a.attn_sink, idx, a.softmax_scale)
                om.apply_rotary_emb(core_ours_in[..., -rd:], fc, True)
                our_core = rec[f"layers.{L}.attn.core"][None].cuda()
                print(p, "core", o22.rel(our_core, core), "core(official on our q,kv)", o22.rel(our_core, core_ours_in))
                oo = core.view(1, S, a.n_local_groups, -1)
                wo_a = a.wo_a.weight.view(a.n_local_groups, a.o_lora_rank, -1)
                y1 = torch.einsum("bsgd,grd->bsgr", oo, wo_a)
                y = a.wo_b(y1.flatten(2))
                oo2 = our_core.view(1, S, a.n_local_groups, -1)
                y2 = a.wo_b(torch.einsum("bsgd,grd->bsgr", oo2, wo_a).flatten(2))
                our_out = rec[f"layers.{L}.attn.out"][None].cuda()
                print(p, "out", o22.rel(our_out, y), "out(official wo on our core)", o22.rel(our_out, y2),
                      "official-forward vs transcription", o22.rel(a(x.clone(), 0), y))
        torch.set_default_dtype(torch.float32)
        torch.set_default_device("cpu")


main()
