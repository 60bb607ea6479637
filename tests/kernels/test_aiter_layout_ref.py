"""aiter layout references vs the closed-form offsets of quant_contracts.md §2.5 / §3.5."""
import pytest
import torch

from glm_ray.kernels.torch_ref.aiter_layout import (
    deinterleave_gate_up_rows,
    e8m0_shuffle,
    e8m0_unshuffle,
    interleave_gate_up_rows,
    shuffle_weight,
    unshuffle_weight,
    x_scale_col_major_bytes,
    x_scale_from_col_major_bytes,
    x_scale_to_col_major,
)


def _coords(n, k, dtype=torch.uint8):
    rows = torch.arange(n).view(n, 1).expand(n, k).to(dtype)
    cols = torch.arange(k).view(1, k).expand(n, k).to(dtype)
    return rows.contiguous(), cols.contiguous()


def test_shuffle_weight_offsets_1byte():
    # §2.5: n = 16*n0 + n1, k = 32*k0 + 16*k1 + k2 -> ((n0*(K/32) + k0)*2 + k1)*256 + n1*16 + k2
    N, K = 48, 96
    rows, cols = _coords(N, K)
    sr, sc = shuffle_weight(rows).flatten(), shuffle_weight(cols).flatten()
    for n in range(N):
        for k in range(K):
            n0, n1 = divmod(n, 16)
            k0, r = divmod(k, 32)
            k1, k2 = divmod(r, 16)
            off = ((n0 * (K // 32) + k0) * 2 + k1) * 256 + n1 * 16 + k2
            assert (sr[off].item(), sc[off].item()) == (n, k)


def test_shuffle_weight_offsets_2byte():
    # 2-byte elements: 16-byte rows hold 8 elements; a 16x32 tile has 4 chunk columns of 16 rows x 8
    # k = 32*k0 + 8*kc + kp -> ((n0*(K/32) + k0)*4 + kc)*128 + n1*8 + kp
    N, K = 32, 64
    rows, cols = _coords(N, K, torch.int16)
    sr, sc = shuffle_weight(rows).flatten(), shuffle_weight(cols).flatten()
    for n in range(N):
        for k in range(K):
            n0, n1 = divmod(n, 16)
            k0, r = divmod(k, 32)
            kc, kp = divmod(r, 8)
            off = ((n0 * (K // 32) + k0) * 4 + kc) * 128 + n1 * 8 + kp
            assert (sr[off].item(), sc[off].item()) == (n, k)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.bfloat16])
def test_shuffle_roundtrip_and_experts(dtype):
    torch.manual_seed(0)
    w = (torch.randn(3, 64, 128) * 10).to(dtype) if dtype != torch.uint8 else \
        torch.randint(0, 256, (3, 64, 128), dtype=torch.uint8)
    s = shuffle_weight(w)
    assert s.shape == w.shape and s.dtype == w.dtype and s.is_shuffled
    assert not torch.equal(s.view(torch.uint8) if dtype != torch.bfloat16 else s.float(),
                           w.view(torch.uint8) if dtype != torch.bfloat16 else w.float())
    for e in range(3):                                             # per-expert shuffle
        assert torch.equal(s[e].view(torch.uint8) if dtype.itemsize == 1 else s[e],
                           shuffle_weight(w[e]).view(torch.uint8) if dtype.itemsize == 1 else shuffle_weight(w[e]))
    u = unshuffle_weight(s)
    assert torch.equal(u.view(torch.uint8) if dtype.itemsize == 1 else u,
                       w.view(torch.uint8) if dtype.itemsize == 1 else w)


def test_shuffle_fp4x2_view():
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4x2 is None:
        pytest.skip("torch without float4_e2m1fn_x2")
    p = torch.randint(0, 256, (32, 64), dtype=torch.uint8)       # packed [N, K/2]
    s = shuffle_weight(p.view(fp4x2))
    assert s.dtype == fp4x2
    assert torch.equal(s.view(torch.uint8), shuffle_weight(p))
    assert torch.equal(unshuffle_weight(s).view(torch.uint8), p)


def test_shuffle_bad_shape():
    with pytest.raises(ValueError):
        shuffle_weight(torch.zeros(16, 48, dtype=torch.uint8))
    with pytest.raises(ValueError):
        shuffle_weight(torch.zeros(8, 64, dtype=torch.uint8))


def test_e8m0_shuffle_offsets_and_padding():
    # §3.5: r = 32a + 16b + cc, c = 8d + 4e + f -> a*32*sn + d*256 + f*64 + cc*4 + e*2 + b
    m, n = 40, 12
    rows, cols = _coords(m, n)
    sr, sc = e8m0_shuffle(rows), e8m0_shuffle(cols + 1)
    assert sr.shape == (256, 16)
    sn = 16
    fr, fc = sr.flatten(), sc.flatten()
    hit = torch.zeros(256 * 16, dtype=torch.bool)
    for r in range(m):
        for c in range(n):
            a, rr = divmod(r, 32)
            b, cc = divmod(rr, 16)
            d, cr = divmod(c, 8)
            e, f = divmod(cr, 4)
            off = a * 32 * sn + d * 256 + f * 64 + cc * 4 + e * 2 + b
            assert (fr[off].item(), fc[off].item()) == (r, c + 1)
            hit[off] = True
    assert (fc[~hit] == 0).all()                                   # padding bytes (zero-filled here)
    assert torch.equal(e8m0_unshuffle(sc, m, n), cols + 1)


def test_e8m0_shuffle_moe_batched():
    s = torch.randint(0, 256, (2, 128, 16), dtype=torch.uint8)   # [E, N, K/32], E*N % 256 == 0
    sh = e8m0_shuffle(s)
    assert sh.shape == s.shape
    assert torch.equal(sh.view(256, 16), e8m0_shuffle(s.view(256, 16)))
    assert torch.equal(e8m0_unshuffle(sh), s)
    with pytest.raises(ValueError):
        e8m0_shuffle(torch.zeros(2, 100, 16, dtype=torch.uint8))


def test_x_scale_col_major():
    s = torch.arange(12, dtype=torch.float32).view(3, 4)           # [M=3, G=4]
    c = x_scale_to_col_major(s)
    assert c.stride() == (1, 3) and torch.equal(c, s)
    # storage order is [G][M]: 0, 4, 8, 1, 5, 9, ...
    assert torch.as_strided(c, (12,), (1,)).tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    b = x_scale_col_major_bytes(s)
    assert b.shape == (3, 4) and b.flatten().tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    assert torch.equal(x_scale_from_col_major_bytes(b), s)
    one = torch.tensor([[1.0, 2.0, 3.0]])                          # M == 1: layouts coincide
    assert torch.equal(x_scale_col_major_bytes(one), one) and torch.equal(x_scale_to_col_major(one), one)


def test_interleave_gate_up_rows():
    w = torch.tensor([[[10.0], [11.0], [20.0], [21.0]]])           # [E=1, 2I=4, 1]: g0 g1 u0 u1
    il = interleave_gate_up_rows(w)
    assert il[0, :, 0].tolist() == [10.0, 20.0, 11.0, 21.0]
    assert torch.equal(deinterleave_gate_up_rows(il), w)
