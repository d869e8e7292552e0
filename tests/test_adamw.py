"""tritonllm.optim.AdamW and clip_grad_norm_ against torch.optim.AdamW / torch.nn.utils.clip_grad_norm_
and float64 references."""

import io

import pytest
import torch

from _checks import DEVICE, ON_GPU, assert_close, dtype_id, randn
from tritonllm.kernels import adamw_step_
from tritonllm.optim import AdamW, clip_grad_norm_

LOW = [torch.float16, torch.bfloat16]
#: (shape, group) of the parameters of the multi-group tests
PARAMS = [((5,), 0), ((17, 33), 0), ((3, 5, 7), 0), ((1,), 1), ((1000,), 1), ((123, 45), 1), ((257,), 2)]
GROUPS = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0), dict(lr=2e-2, weight_decay=0.3)]


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Chunks of a few thousand elements, so the test tensors span several chunks and loop steps."""
    import tritonllm.kernels.adamw as adamw

    monkeypatch.setattr(adamw, "_INTERPRET_CHUNK", 2048)
    monkeypatch.setattr(adamw, "_INTERPRET_BLOCK", 1024)


def leaf(t):
    return t.detach().requires_grad_(True)


def unaligned(n, dtype=torch.float32):
    """A contiguous parameter whose address is not 16-byte aligned (a view one element into a buffer)."""
    return leaf(randn(n + 1, dtype=dtype)[1:])


def make_params(dtype=torch.float32):
    params = [leaf(randn(*shape, dtype=dtype)) for shape, _ in PARAMS]
    params.append(unaligned(63, dtype))
    return params


def group_of(i):
    return PARAMS[i][1] if i < len(PARAMS) else 2


def grouped(params):
    return [dict(params=[p for i, p in enumerate(params) if group_of(i) == g], **GROUPS[g])
            for g in range(len(GROUPS))]


def set_grads(params_lists, grads, skip=()):
    for params in params_lists:
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if i in skip else g.to(p.dtype).clone()


def test_matches_torch_adamw():
    """10 steps, three groups (different lr and weight decay, one without), odd shapes, an unaligned
    parameter, a parameter skipped at one step (no gradient), lr changed mid-run, fresh gradient
    tensors every step."""
    ours = make_params()
    same = [leaf(p.clone()) for p in ours]
    ref = [leaf(p.double()) for p in ours]
    opt = AdamW(grouped(ours), lr=1e-3)
    opt_same = torch.optim.AdamW(grouped(same), lr=1e-3, foreach=False)
    opt_ref = torch.optim.AdamW(grouped(ref), lr=1e-3, foreach=False)
    opts = (opt, opt_same, opt_ref)
    for step in range(10):
        if step == 5:
            for o in opts:
                o.param_groups[0]["lr"] = 5e-2
        grads = [randn(*p.shape) for p in ours]
        set_grads((ours, same, ref), grads, skip={3} if step == 2 else ())
        for o in opts:
            o.step()
    for i, (p, s, r) in enumerate(zip(ours, same, ref)):
        assert_close(f"param{i}", p, r, same=s)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(f"{key}{i}", opt.state[p][key], opt_ref.state[r][key], same=opt_same.state[s][key])
        assert opt.state[p]["step"] == int(opt_ref.state[r]["step"])


def _assert_rounded(name, p, master):
    """The low-precision parameter is its fp32 master rounded to nearest (one ulp of slack under the
    interpreter, whose bfloat16 conversion does not round to nearest)."""
    want = master.to(p.dtype)
    if ON_GPU or p.dtype == torch.float16:
        assert torch.equal(p.detach(), want), f"{name}: parameter is not its master rounded"
    else:
        ulp = want.float().abs() * 2.0 ** -7 + 1e-30
        assert ((p.detach().float() - want.float()).abs() <= ulp).all(), f"{name}: more than one ulp from master"


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_master_weights(dtype):
    """bf16/fp16 parameters: the fp32 master follows a float64 AdamW of the master values, and the
    parameter is the rounded master."""
    ours = make_params(dtype)
    ours[1] = leaf(ours[1].float())  # an fp32 parameter in the same group: updated without a master
    ref = [leaf(p.double()) for p in ours]
    same = [leaf(p.float()) for p in ours]
    opt = AdamW(grouped(ours))
    opt_ref = torch.optim.AdamW(grouped(ref), foreach=False)
    opt_same = torch.optim.AdamW(grouped(same), foreach=False)
    for _ in range(10):
        grads = [randn(*p.shape, dtype=dtype) for p in ours]
        set_grads((ours, ref, same), grads)
        for o in (opt, opt_ref, opt_same):
            o.step()
    for i, (p, r, s) in enumerate(zip(ours, ref, same)):
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        if p.dtype == torch.float32:
            assert "master" not in opt.state[p]
            assert_close(f"param{i}", p, r, same=s)
            continue
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32
        assert_close(f"master{i}", master, r, same=s)
        _assert_rounded(f"param{i}", p, master)


def test_no_master_weights():
    """master_weights=False: an fp16 parameter is updated in fp32 math and rounded every step."""
    ours = make_params(torch.float16)
    ref = [leaf(p.double()) for p in ours]
    opt = AdamW(grouped(ours), master_weights=False)
    opt_ref = torch.optim.AdamW(grouped(ref), foreach=False)
    for _ in range(5):
        grads = [randn(*p.shape, dtype=torch.float16) for p in ours]
        set_grads((ours, ref), grads)
        opt.step()
        opt_ref.step()
        with torch.no_grad():
            for r in ref:
                r.copy_(r.half())
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert "master" not in opt.state[p]
        assert_close(f"param{i}", p, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_state_dict_round_trip(dtype):
    """Resume from a saved state_dict (through torch.save / torch.load as a checkpoint does): the
    resumed optimizer continues bit for bit."""
    a = make_params(dtype)
    opt_a = AdamW(grouped(a))
    grads = [[randn(*p.shape) for p in a] for _ in range(6)]
    for g in grads[:3]:
        set_grads((a,), g)
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    b = [leaf(p.clone()) for p in a]
    opt_b = AdamW(grouped(b), lr=0.5, weight_decay=0.0)
    opt_b.load_state_dict(torch.load(buf, map_location="cpu", weights_only=True))
    assert opt_b.param_groups[0]["lr"] == GROUPS[0]["lr"]
    for p, q in zip(a, b):
        for key, value in opt_a.state[p].items():
            loaded = opt_b.state[q][key]
            if torch.is_tensor(value):
                assert loaded.dtype == torch.float32 and loaded.device == q.device and torch.equal(loaded, value)
            else:
                assert loaded == value
    for g in grads[3:]:
        set_grads((a, b), g)
        opt_a.step()
        opt_b.step()
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), f"param{i} differs after resuming"
        if dtype != torch.float32:
            assert torch.equal(opt_a.state[p]["master"], opt_b.state[q]["master"])


def test_load_torch_adamw_state():
    """A torch.optim.AdamW state_dict loads (tensor step) and the run continues as torch's does."""
    a = make_params()
    ref = [leaf(p.clone()) for p in a]
    torch_opt = torch.optim.AdamW(grouped(ref), foreach=False)
    for _ in range(2):
        set_grads((ref,), [randn(*p.shape) for p in a])
        torch_opt.step()
    with torch.no_grad():
        for p, r in zip(a, ref):
            p.copy_(r)
    opt = AdamW(grouped(a))
    opt.load_state_dict(torch_opt.state_dict())
    set_grads((a, ref), [randn(*p.shape) for p in a])
    opt.step()
    torch_opt.step()
    for i, (p, r) in enumerate(zip(a, ref)):
        assert_close(f"param{i}", p, r)


def test_param_group_added():
    """Adding a group changes the parameter set: the next step covers it (tables rebuilt)."""
    ours = make_params()
    ref = [leaf(p.double()) for p in ours]
    opt = AdamW([ours[0], ours[1]], lr=1e-2)
    opt_ref = torch.optim.AdamW([ref[0], ref[1]], lr=1e-2, foreach=False)
    for step in range(4):
        if step == 2:
            opt.add_param_group(dict(params=ours[2:], lr=3e-2, weight_decay=0.0))
            opt_ref.add_param_group(dict(params=ref[2:], lr=3e-2, weight_decay=0.0))
        set_grads((ours, ref), [randn(*p.shape) for p in ours])
        opt.step()
        opt_ref.step()
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert_close(f"param{i}", p, r)


def _grads(dtypes):
    shapes = [(5,), (17, 33), (1,), (1000,), (123, 45)]
    params = [leaf(randn(*s, dtype=dtypes[i % len(dtypes)])) for i, s in enumerate(shapes)]
    params.append(unaligned(63))
    for p in params:
        p.grad = randn(*p.shape, dtype=p.dtype)
    return params


@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float32, torch.float16]], ids=["fp32", "fp32+fp16"])
@pytest.mark.parametrize("clips", [True, False], ids=["clipped", "not-clipped"])
def test_clip_grad_norm(clips, dtypes):
    params = _grads(dtypes)
    params.append(leaf(randn(7)))  # no gradient: ignored
    same = [leaf(p.clone()) for p in params]
    grads64 = [p.grad.double() for p in params if p.grad is not None]
    for s, p in zip(same, params):
        s.grad = None if p.grad is None else p.grad.clone()
    norm64 = torch.sqrt(sum((g ** 2).sum() for g in grads64))
    max_norm = 0.25 * norm64.item() if clips else 4.0 * norm64.item()
    coef = min(1.0, max_norm / (norm64.item() + 1e-6))
    norm = clip_grad_norm_(params, max_norm)
    norm_same = torch.nn.utils.clip_grad_norm_(same, max_norm)
    assert norm.dim() == 0 and norm.dtype == torch.float32
    assert_close("norm", norm, norm64, same=norm_same)
    with_grad = [(p, s) for p, s in zip(params, same) if p.grad is not None]
    for i, ((p, s), g64) in enumerate(zip(with_grad, grads64)):
        assert_close(f"grad{i}", p.grad, g64 * coef, same=s.grad)
    if not clips:
        assert all(torch.equal(p.grad, s.grad) for p, s in with_grad)


def test_clip_grad_norm_single_tensor_and_no_grads():
    p = leaf(randn(10))
    assert clip_grad_norm_(p, 1.0).item() == 0.0
    p.grad = torch.full((10,), 3.0, device=DEVICE)
    assert_close("norm", clip_grad_norm_(p, 1.0), torch.tensor(90.0 ** 0.5, dtype=torch.float64))


def test_bad_inputs():
    p = leaf(randn(4))
    with pytest.raises(ValueError, match="lr"):
        AdamW([p], lr=-1.0)
    for betas in ((1.0, 0.999), (0.9, -0.1)):
        with pytest.raises(ValueError, match="betas"):
            AdamW([p], betas=betas)
    with pytest.raises(ValueError, match="eps"):
        AdamW([p], eps=-1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        AdamW([p], weight_decay=-0.1)
    opt = AdamW([p])
    opt.param_groups[0]["lr"] = -1.0
    p.grad = randn(4)
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    q = leaf(randn(10, 10).t())
    q.grad = randn(10, 10).t()
    with pytest.raises(ValueError, match="params"):
        AdamW([q]).step()
    m = torch.zeros(4, device=DEVICE)
    step = [torch.zeros((), device=DEVICE)]
    with pytest.raises(ValueError, match="grads"):
        adamw_step_([p.detach()], [], [m], [m.clone()], lr=1e-3, steps=step)
    with pytest.raises(TypeError, match="exp_avgs"):
        adamw_step_([p.detach()], [p.grad], [m.half()], [m.clone()], lr=1e-3, steps=step)
    with pytest.raises(TypeError, match="masters"):
        adamw_step_([p.detach()], [p.grad], [m], [m.clone()], [m.clone()], lr=1e-3, steps=step)
    with pytest.raises(TypeError, match="steps"):
        adamw_step_([p.detach()], [p.grad], [m], [m.clone()], lr=1e-3, steps=[torch.zeros((), dtype=torch.int64)])
    with pytest.raises(TypeError, match="lr"):
        adamw_step_([p.detach()], [p.grad], [m], [m.clone()], lr=torch.tensor(1e-3, dtype=torch.float64), steps=step)
    with pytest.raises(TypeError, match="found_inf"):
        adamw_step_([p.detach()], [p.grad], [m], [m.clone()], lr=1e-3, steps=step, found_inf=torch.zeros(()))
    with pytest.raises(TypeError, match="check"):
        clip_grad_norm_([p], 1.0, found_inf=torch.zeros((), dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_([p], -1.0)


@pytest.mark.gpu
def test_gpt2_sized_step():
    """A GPT-2 124M-shaped parameter set (bf16 with masters) against torch fp32 AdamW on the masters."""
    shapes = [(50257, 768), (1024, 768)] + [(2304, 768), (2304,), (768, 768), (768,), (3072, 768), (3072,),
                                            (768, 3072), (768,), (768,), (768,)] * 2
    ours = [leaf(randn(*s, dtype=torch.bfloat16)) for s in shapes]
    same = [leaf(p.float()) for p in ours]
    ref = [leaf(p.double()) for p in ours]
    opt, opt_same, opt_ref = AdamW(ours), torch.optim.AdamW(same), torch.optim.AdamW(ref)
    for _ in range(3):
        set_grads((ours, same, ref), [randn(*s, dtype=torch.bfloat16) for s in shapes])
        for o in (opt, opt_same, opt_ref):
            o.step()
    for i, (p, s, r) in enumerate(zip(ours, same, ref)):
        assert_close(f"master{i}", opt.state[p]["master"], r, same=s)
        _assert_rounded(f"param{i}", p, opt.state[p]["master"])


def test_device_lr_and_found_inf_skip():
    """lr as a device tensor and a device skip flag (what a CUDA-graphed step uses): a step whose flag
    is set changes nothing (weights, masters, moments, step counts); the others equal, bit for bit,
    an optimizer given the same lr as a float that never saw the skipped step."""
    ours = make_params(torch.bfloat16)
    twin = [leaf(p.clone()) for p in ours]
    lr = torch.zeros((), dtype=torch.float32, device=DEVICE)
    opt = AdamW(grouped(ours), lr=1e-3)
    for group in opt.param_groups:
        group["lr"] = lr
    opt_twin = AdamW(grouped(twin), lr=1e-3)
    flag = torch.zeros((), dtype=torch.int32, device=DEVICE)
    for step in range(5):
        lr.fill_(1e-2 * (step + 1))
        grads = [randn(*p.shape, dtype=p.dtype) for p in ours]
        set_grads((ours, twin), grads)
        if step == 2:
            flag.fill_(1)
            before = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(ours)}
            weights = [p.detach().clone() for p in ours]
            opt.step(found_inf=flag)
            for i, p in enumerate(ours):
                assert torch.equal(p.detach(), weights[i]), f"param{i} changed in a skipped step"
                for key, value in opt.state[p].items():
                    assert torch.equal(value, before[i][key]), f"{key}{i} changed in a skipped step"
            flag.fill_(0)
            continue
        for group in opt_twin.param_groups:
            group["lr"] = 1e-2 * (step + 1)
        opt.step(found_inf=flag)
        opt_twin.step()
    for i, (p, t) in enumerate(zip(ours, twin)):
        assert torch.equal(p.detach(), t.detach()), f"param{i}"
        for key in ("exp_avg", "exp_avg_sq", "master", "step"):
            assert torch.equal(opt.state[p][key], opt_twin.state[t][key]), f"{key}{i}"
    assert float(opt.state[ours[0]]["step"]) == 4.0
    saved = opt.state_dict()
    assert all(isinstance(g["lr"], float) for g in saved["param_groups"]), "a device lr is saved as a float"


@pytest.mark.parametrize("bad", ["finite", "nan-loss", "inf-loss", "inf-grad", "nan-grad"])
def test_clip_sets_found_inf(bad):
    params = _grads([torch.float32])
    if bad.endswith("grad"):
        params[1].grad.view(-1)[3] = float("inf") if bad == "inf-grad" else float("nan")
    loss = torch.tensor({"nan-loss": float("nan"), "inf-loss": float("-inf")}.get(bad, 2.5), device=DEVICE)
    flag = torch.full((), 7, dtype=torch.int32, device=DEVICE)  # stale value: always overwritten
    clip_grad_norm_(params, 1.0, found_inf=flag, check=loss)
    assert int(flag) == (0 if bad == "finite" else 1)
