"""One rank of the torch.distributed backend test (started by test_multiprocess.py through
chorus-run, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT). Every collective runs
on the default group (chorus) and on a Gloo group of the same ranks with the same inputs; the
results must be equal (exactly, on integer-valued inputs) and equal to the naive reference
where one is simple. Then a chorus subgroup, objects, async work and the unsupported cases.
Prints ``ok torch_backend rank R``."""

import functools
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import chorus
import chorus.backend  # noqa: F401 - registers "chorus"


def check(what, got, want):
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.flatten()[:8]}, want {want.flatten()[:8]}")


# The dtypes Gloo (torch 1.13) reduces; it refuses bfloat16 ("Invalid scalar type").
GLOO_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.uint8)


def both(fn, dtype=torch.float32):
    """``fn(group)`` on chorus's default group and on the Gloo group (None where Gloo does
    not take ``dtype``); returns the two."""
    return fn(None), (fn(GLOO) if dtype in GLOO_DTYPES else None)


def main():
    global GLOO
    dist.init_process_group("chorus")
    me, p = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "chorus", dist.get_backend()
    GLOO = dist.new_group(backend="gloo")
    dtypes = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.uint8]

    def vals(dt, n=10, r=None):
        r = me if r is None else r
        return (torch.arange(n) % 3 + r + 1).to(dt)

    # all_reduce, every dtype and op; complex sums
    ops = {
        dist.ReduceOp.SUM: torch.add,
        dist.ReduceOp.PRODUCT: torch.mul,
        dist.ReduceOp.MIN: torch.minimum,
        dist.ReduceOp.MAX: torch.maximum,
    }
    for dt in dtypes:
        for op, f in ops.items():
            # The naive reference in the dtype (uint8 products wrap as chorus's do) ...
            ref = functools.reduce(f, [vals(dt, r=r) for r in range(p)])
            a, b = both(lambda g: (lambda t: (dist.all_reduce(t, op=op, group=g), t)[1])(vals(dt)), dt)
            check(f"all_reduce {dt} {op}", a, ref)
            # ... and Gloo, for the dtypes it reduces.
            if b is not None:
                check(f"all_reduce {dt} {op} against Gloo", a, b)
    want = sum(vals(torch.float64, r=r) for r in range(p))
    t = vals(torch.float64)
    dist.all_reduce(t)
    check("all_reduce against the reference", t, want)
    z = torch.complex(vals(torch.float32), -vals(torch.float32))
    dist.all_reduce(z)
    check("complex all_reduce", z, torch.complex(want.float(), -want.float()))
    # broadcast from every root
    for root in range(p):
        a, b = both(lambda g: (lambda t: (dist.broadcast(t, root, group=g), t)[1])(vals(torch.int64)))
        check(f"broadcast root {root}", a, b)
        check(f"broadcast root {root} value", a, vals(torch.int64, r=root))
    # reduce to the last rank
    a, b = both(lambda g: (lambda t: (dist.reduce(t, p - 1, group=g), t)[1])(vals(torch.float32)))
    if me == p - 1:  # elsewhere the tensor is undefined after a reduce (Gloo's holds partial sums)
        check("reduce", a, b)
        check("reduce value", a, want.float())
    # all_gather (equal sizes), and of different sizes (chorus only: Gloo needs equal sizes)
    def ag(g):
        out = [torch.zeros(10, dtype=torch.int32) for _ in range(p)]
        dist.all_gather(out, vals(torch.int32), group=g)
        return torch.stack(out)
    a, b = both(ag)
    check("all_gather", a, b)
    out = [torch.full((r + 1, 2), -1.0) for r in range(p)]
    dist.all_gather(out, torch.full((me + 1, 2), float(me)))
    for r in range(p):
        check(f"all_gather of different sizes [{r}]", out[r], torch.full((r + 1, 2), float(r)))
    # all_gather_into_tensor
    out = torch.zeros(p * 6, dtype=torch.float64)
    dist.all_gather_into_tensor(out, vals(torch.float64, 6))
    check("all_gather_into_tensor", out, torch.cat([vals(torch.float64, 6, r) for r in range(p)]))
    # reduce_scatter and reduce_scatter_tensor (Gloo 1.13 has neither on CPU: the reference)
    ins = [vals(torch.float32, 5) * (j + 1) for j in range(p)]
    o = torch.zeros(5)
    dist.reduce_scatter(o, ins)
    check("reduce_scatter", o, sum(vals(torch.float32, 5, r) for r in range(p)) * (me + 1))
    # of different sizes: input j has rank j's output size, j + 1 values
    ins = [torch.arange(j + 1, dtype=torch.float64) * (me + 1) for j in range(p)]
    o = torch.full((me + 1,), -1.0, dtype=torch.float64)
    dist.reduce_scatter(o, ins)
    check("reduce_scatter of different sizes", o, torch.arange(me + 1, dtype=torch.float64) * (p * (p + 1) // 2))
    ins = [vals(torch.float32, 5) * (j + 1) for j in range(p)]
    o = torch.zeros(5)
    dist.reduce_scatter_tensor(o, torch.cat(ins), op=dist.ReduceOp.MAX)
    check("reduce_scatter_tensor max", o, vals(torch.float32, 5, p - 1) * (me + 1))
    # all_to_all_single, equal and with split sizes; all_to_all of lists
    def a2a(g):
        out = torch.zeros(p * 3, dtype=torch.int64)
        dist.all_to_all_single(out, torch.arange(p * 3) + 100 * me, group=g)
        return out
    a, b = both(a2a)
    check("all_to_all_single", a, b)
    send = [(me + j) % 3 for j in range(p)]  # rows to rank j
    recv = [(j + me) % 3 for j in range(p)]  # rows from rank j
    x = torch.cat([torch.full((send[j], 2), float(10 * me + j)) for j in range(p)])
    y = torch.zeros(sum(recv), 2)
    dist.all_to_all_single(y, x, recv, send)
    check("all_to_all_single with splits", y, torch.cat([torch.full((recv[j], 2), float(10 * j + me)) for j in range(p)]))
    # ... where some ranks' own splits happen to be equal and others' not: rank 0 sends and
    # receives 1 row per rank, the others 1 row to and from rank 0 and 2 rows among themselves.
    rows = [1 if me == 0 or j == 0 else 2 for j in range(p)]
    x = torch.cat([torch.full((rows[j],), float(10 * me + j)) for j in range(p)])
    y = torch.zeros(sum(rows))
    dist.all_to_all_single(y, x, rows, rows)
    check("all_to_all_single with equal splits on one rank only", y, torch.cat([torch.full((rows[j],), float(10 * j + me)) for j in range(p)]))
    def a2al(g):
        outs = [torch.zeros(4) for _ in range(p)]
        dist.all_to_all(outs, [torch.full((4,), float(10 * me + j)) for j in range(p)], group=g)
        return torch.stack(outs)
    a = a2al(None)
    check("all_to_all", a, torch.stack([torch.full((4,), float(10 * j + me)) for j in range(p)]))
    # gather and scatter, root 1 % p
    root = 1 % p
    outs = [torch.zeros(3) for _ in range(p)] if me == root else None
    dist.gather(torch.full((3,), float(me)), outs, dst=root)
    if me == root:
        check("gather", torch.stack(outs), torch.stack([torch.full((3,), float(r)) for r in range(p)]))
    got = torch.zeros(3)
    dist.scatter(got, [torch.full((3,), float(j * 7)) for j in range(p)] if me == root else None, src=root)
    check("scatter", got, torch.full((3,), float(me * 7)))
    # ... and of tensors of different sizes (rank j's of j + 1 rows; Gloo needs equal ones)
    outs = [torch.zeros(j + 1, 2) for j in range(p)] if me == root else None
    dist.gather(torch.full((me + 1, 2), float(me)), outs, dst=root)
    if me == root:
        check("gather of different sizes", torch.cat(outs), torch.cat([torch.full((j + 1, 2), float(j)) for j in range(p)]))
    got = torch.zeros(me + 1, 2, dtype=torch.float64)
    ins = [torch.full((j + 1, 2), j * 0.5, dtype=torch.float64) for j in range(p)] if me == root else None
    dist.scatter(got, ins, src=root)
    check("scatter of different sizes", got, torch.full((me + 1, 2), me * 0.5, dtype=torch.float64))
    # send/recv around a ring, even ranks first
    if p > 1:
        right, left = (me + 1) % p, (me - 1) % p
        s, r = torch.full((1000,), float(me)), torch.zeros(1000)
        if me % 2 == 0:
            dist.send(s, right)
            dist.recv(r, left)
        else:
            dist.recv(r, left)
            dist.send(s, right)
        check("send/recv", r, torch.full((1000,), float(left)))
    # batch_isend_irecv around a ring with 4 MiB messages (beyond any transport buffer):
    # each rank's send and receive run together
    if p > 1:
        right, left = (me + 1) % p, (me - 1) % p
        s, r = torch.full((1 << 20,), float(me)), torch.zeros(1 << 20)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, right), dist.P2POp(dist.irecv, r, left)])
        for q in reqs:
            q.wait()
        check("batch_isend_irecv ring", r, torch.full((1 << 20,), float(left)))
        # torch 2.1 and later take the work of the whole batch from _end_coalescing and wait
        # for it (called here as they call it).
        pg = dist.distributed_c10d._get_default_group()
        s, r = torch.full((1 << 20,), float(me) + 0.5), torch.zeros(1 << 20)
        pg._start_coalescing(torch.device("cpu"))
        pg.send([s], right, 0)
        pg.recv([r], left, 0)
        work = pg._end_coalescing(torch.device("cpu"))
        assert work.wait() and work.is_completed() and work.is_success()
        check("a coalesced batch's work", r, torch.full((1 << 20,), float(left) + 0.5))
        work.get_future().wait()
        # a halo exchange in one batch, 4 MiB each way, all posted together (with one
        # neighbour both ways, the messages of each direction pair up in order)
        big = 1 << 20
        to_l, to_r = torch.full((big,), 10.0 * me + 1), torch.full((big,), 10.0 * me + 2)
        from_l, from_r = torch.zeros(big), torch.zeros(big)
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, to_l, left), dist.P2POp(dist.isend, to_r, right),
            dist.P2POp(dist.irecv, from_l, left), dist.P2POp(dist.irecv, from_r, right),
        ])
        for q in reqs:
            q.wait()
        if p > 2:
            check("halo from the left", from_l, torch.full((big,), 10.0 * left + 2))
            check("halo from the right", from_r, torch.full((big,), 10.0 * right + 1))
        else:  # one neighbour, both ways: messages pair up in the order sent
            check("halo from the one neighbour", torch.stack([from_l, from_r]),
                  torch.stack([torch.full((big,), 10.0 * left + 1), torch.full((big,), 10.0 * left + 2)]))
        # irecv first, then a blocking send of 4 MiB, then wait: pairs of ranks
        if me ^ 1 < p:
            peer = me ^ 1
            got = torch.zeros(big, dtype=torch.float64)
            req = dist.irecv(got, peer)
            dist.send(torch.full((big,), float(me), dtype=torch.float64), peer)
            req.wait()
            check("irecv before send", got, torch.full((big,), float(peer), dtype=torch.float64))
            # mixed dtypes of one size in a batch: bytes move
            a = torch.arange(8, dtype=torch.float32) + me
            b = torch.zeros(4, dtype=torch.int64)
            for q in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
                q.wait()
            check("mixed dtypes", b.view(torch.float32), torch.arange(8, dtype=torch.float32) + peer)
            # wait(timeout) on a receive raises once the time passes, and the transfer goes on:
            # the lower rank of the pair waits first; the higher one sends only when told
            late = torch.zeros(4)
            if me < peer:
                w = dist.irecv(late, peer)
                try:
                    w.wait(timeout=timedelta(seconds=0.2))
                except RuntimeError as e:
                    assert "within" in str(e), e
                else:
                    raise AssertionError("wait(timeout) returned before anything was sent")
                dist.send(torch.ones(1), peer)
                w.wait()
                check("a receive waited for again", late, torch.full((4,), float(peer)))
            else:
                dist.recv(torch.zeros(1), peer)
                dist.send(torch.full((4,), float(me)), peer)
        # a batch that fails while it is made (a valid 4 MiB exchange, then tag 3) sends
        # nothing, on every rank: the next exchange with the same neighbours reads fresh data
        # (a 4 MiB message left over would arrive where 16 floats are expected)
        try:
            dist.batch_isend_irecv([
                dist.P2POp(dist.isend, to_l, left), dist.P2POp(dist.irecv, from_l, left),
                dist.P2POp(dist.isend, to_l, left, tag=3),
            ])
        except chorus.ChorusError as e:
            assert "tag" in e.message, e.message
        else:
            raise AssertionError("a batch with tag 3 ran")
        # likewise a peer outside the group (torch does not check it)
        try:
            dist.batch_isend_irecv([
                dist.P2POp(dist.isend, to_l, left), dist.P2POp(dist.irecv, from_l, left),
                dist.P2POp(dist.isend, to_l, p),
            ])
        except chorus.ChorusError as e:
            assert "peer" in e.message, e.message
        else:
            raise AssertionError("a batch with a peer outside the group ran")
        fresh_out, fresh_in = torch.full((16,), 1000.0 + me), torch.zeros(16)
        for q in dist.batch_isend_irecv([dist.P2POp(dist.isend, fresh_out, right), dist.P2POp(dist.irecv, fresh_in, left)]):
            q.wait()
        check("the exchange after a failed batch", fresh_in, torch.full((16,), 1000.0 + left))
        # a small isend to itself waits for its irecv (alone it would be a send without its
        # receive); one tensor both sent and received into in a batch is sent from a copy
        to_self, back = torch.arange(4.0) + me, torch.zeros(4)
        w1, w2 = dist.isend(to_self, me), dist.irecv(back, me)
        w1.wait()
        w2.wait()
        check("isend to itself", back, torch.arange(4.0) + me)
        shared = torch.full((8,), float(me))
        for q in dist.batch_isend_irecv([dist.P2POp(dist.isend, shared, right), dist.P2POp(dist.irecv, shared, left)]):
            q.wait()
        check("one tensor sent and received into", shared, torch.full((8,), float(left)))
        # a receive into a tensor that a live send still reads, in a later call (Gloo takes
        # it): the send goes out as it was, the receive lands once done
        # (16 MiB: the send cannot have finished when the receive is issued)
        buf = torch.full((1 << 22,), float(me))
        w1 = dist.isend(buf, right)
        w2 = dist.irecv(buf, left)
        w1.wait()
        w2.wait()
        check("a receive into a live send's tensor", buf, torch.full((1 << 22,), float(left)))
        # two receives into one tensor in a batch (Gloo takes them; the last message wins),
        # with a receive into another tensor between them
        into, other = torch.zeros(6), torch.zeros(6)
        firsts = [torch.full((6,), 10.0 * me + k) for k in range(3)]
        for q in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, f, right) for f in firsts]
            + [dist.P2POp(dist.irecv, into, left), dist.P2POp(dist.irecv, other, left),
               dist.P2POp(dist.irecv, into, left)]
        ):
            q.wait()
        check("the last of two receives into one tensor", into, torch.full((6,), 10.0 * left + 2))
        check("the receive between them", other, torch.full((6,), 10.0 * left + 1))
        # a collective between a large isend and its wait, the receiver taking the message
        # before it reduces (a transfer that ran only at wait() deadlocked here); and the
        # mirror image, a receive posted before the collective, the sender sending first
        t = torch.ones(5)
        if me ^ 1 >= p:  # no partner: the collectives alone
            dist.all_reduce(t)
            dist.all_reduce(t)
        else:
            peer = me ^ 1
            if me % 2 == 0:
                w = dist.isend(torch.full((big,), 3.0 + me), peer)
                dist.all_reduce(t)
                w.wait()
                got = torch.zeros(big)
                w = dist.irecv(got, peer)
                dist.all_reduce(t)
                w.wait()
                check("irecv across an all_reduce", got, torch.full((big,), 5.0 + peer))
            else:
                got = torch.zeros(big)
                dist.recv(got, peer)
                check("isend across an all_reduce", got, torch.full((big,), 3.0 + peer))
                dist.all_reduce(t)
                dist.send(torch.full((big,), 5.0 + me), peer)
                dist.all_reduce(t)
        check("the all_reduces between", t, torch.full((5,), float(p * p)))
        # a message not yet received does not meet the collectives: rank 0 sends, then
        # everyone reduces, then rank 1 receives
        m = torch.tensor([42.0])
        if me == 0:
            dist.isend(m, 1).wait()
        t = torch.ones(3)
        dist.all_reduce(t)
        check("all_reduce after a pending send", t, torch.full((3,), float(p)))
        if me == 1:
            got = torch.zeros(1)
            dist.recv(got, 0)
            check("the pending message", got, m)
    # two threads calling collectives on one group at once wait for each other (their calls
    # pair up across ranks in whatever order, so both reduce equal tensors); a third thread
    # sends point-to-point meanwhile, on the group's own point-to-point communicator
    errors = []

    def reduce_ones():
        try:
            for _ in range(20):
                t = torch.ones(1000)
                dist.all_reduce(t)
                assert (t == p).all(), t[:4]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def pass_on():
        try:
            if p > 1:
                x = torch.full((100,), float(me))
                if me % 2 == 0:
                    dist.send(x, (me + 1) % p)
                    dist.recv(x, (me - 1) % p)
                else:
                    y = x.clone()
                    dist.recv(x, (me - 1) % p)
                    dist.send(y, (me + 1) % p)
                assert (x == float((me - 1) % p)).all(), x[:4]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (reduce_ones, reduce_ones, pass_on)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a thread did not finish"
    assert not errors, errors
    # dtypes chorus does not reduce still move: bool and int16
    flags = torch.tensor([me % 2 == 0, True, me == 0])
    dist.broadcast(flags, 0)
    check("bool broadcast", flags, torch.tensor([True, True, True]))
    shorts = [torch.zeros(3, dtype=torch.int16) for _ in range(p)]
    dist.all_gather(shorts, torch.full((3,), -me - 1, dtype=torch.int16))
    check("int16 all_gather", torch.stack(shorts), torch.stack([torch.full((3,), -r - 1, dtype=torch.int16) for r in range(p)]))
    # objects
    objs = [None] * p
    dist.all_gather_object(objs, {"rank": me, "name": f"r{me}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(p)], objs
    lst = [me, "x"] if me == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [0, "x"], lst
    gathered = [None] * p if me == 0 else None
    dist.gather_object({"r": me, "pad": "y" * me}, gathered, dst=0)
    if me == 0:
        assert gathered == [{"r": r, "pad": "y" * r} for r in range(p)], gathered
    mine = [None]
    dist.scatter_object_list(mine, [f"to {r}" * (r + 1) for r in range(p)] if me == 0 else None, src=0)
    assert mine[0] == f"to {me}" * (me + 1), mine
    # async work is complete when returned
    t = vals(torch.float32)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    check("async all_reduce", t, want.float())
    # a chorus subgroup of the odd ranks, and one of the last rank alone
    odd = dist.new_group([r for r in range(p) if r % 2 == 1]) if p > 1 else None
    if me % 2 == 1:
        t = torch.tensor([float(me)])
        dist.all_reduce(t, group=odd)
        check("odd group", t, torch.tensor([float(sum(r for r in range(p) if r % 2 == 1))]))
        # the root is a global rank: the last odd one, group rank (size - 1)
        root = p - 1 if (p - 1) % 2 == 1 else p - 2
        t = torch.tensor([float(me * 10)])
        dist.broadcast(t, root, group=odd)
        check("odd group broadcast", t, torch.tensor([float(root * 10)]))
        if p >= 4:
            # a batch that torch itself fails partway (a peer outside the group) starts none
            # of its ops: the next exchange reads fresh data
            other = 4 - me
            try:
                dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, torch.full((4,), 50.0 + me), other, group=odd),
                    dist.P2POp(dist.isend, torch.ones(4), 0, group=odd),
                ])
            except (RuntimeError, ValueError):
                pass
            else:
                raise AssertionError("a batch naming a rank outside its group ran")
            fresh, got = torch.full((4,), 70.0 + me), torch.zeros(4)
            for q in dist.batch_isend_irecv([
                dist.P2POp(dist.isend, fresh, other, group=odd),
                dist.P2POp(dist.irecv, got, other, group=odd),
            ]):
                q.wait()
            check("the exchange after a batch torch failed", got, torch.full((4,), 70.0 + other))
    alone = dist.new_group([p - 1])
    if me == p - 1:
        t = torch.tensor([5.0])
        dist.all_reduce(t, group=alone)
        check("group of one", t, torch.tensor([5.0]))
    # unsupported, refused on every rank alike (nothing sent)
    # bitwise reductions of integers, against Gloo
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        a, b = both(lambda g: (lambda t: (dist.all_reduce(t, op=op, group=g), t)[1])(
            torch.tensor([1 << me, 0xFF ^ me, me * 37, -1 - me], dtype=torch.int64)), torch.int64)
        check(f"all_reduce {op} against Gloo", a, b)
    # A tensor that requires grad is reduced as Gloo reduces it (in place, not differentiated).
    w = torch.full((3,), float(me + 1), requires_grad=True) * 1
    dist.all_reduce(w)
    check("all_reduce of a tensor that requires grad", w.detach(), torch.full((3,), float(p * (p + 1) // 2)))
    for what, f in [
        ("bitwise and of floats", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)),
        ("tag", lambda: dist.send(torch.ones(2), (me + 1) % p, tag=3)),
        ("any source", lambda: dist.recv(torch.ones(2))),
        ("non-contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t())),
        ("sparse", lambda: dist.all_reduce(torch.eye(3).to_sparse())),
        ("sparse, moved as bytes", lambda: dist.broadcast(torch.eye(3).to_sparse(), 0)),
        ("several tensors", lambda: dist.all_reduce_multigpu([torch.ones(2), torch.ones(2)])),
        ("reduce_scatter_tensor of two dtypes",
         lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * p, dtype=torch.float64))),
    ]:
        try:
            f()
        except chorus.ChorusError as e:
            assert "chorus backend" in e.message or "bitwise" in e.message, (what, e.message)
        else:
            raise AssertionError(f"{what}: no error")
    # all_reduce_coalesced reduces a tensor listed twice once (as Gloo: one flat copy).
    t = torch.full((3,), float(me + 1))
    u = torch.full((2,), 1.0, dtype=torch.float32)
    dist.all_reduce_coalesced([t, u, t])
    check("all_reduce_coalesced of a tensor listed twice", t, torch.full((3,), float(p * (p + 1) // 2)))
    check("all_reduce_coalesced's other tensor", u, torch.full((2,), float(p)))
    with torch.inference_mode():
        i1, i2 = torch.ones(2), torch.ones(3)
    dist.all_reduce_coalesced([i1, i2])  # inference tensors, outside inference mode
    check("all_reduce_coalesced of inference tensors", i2, torch.full((3,), float(p)))
    # A group whose timeout is "none" (longer than chorus takes) is made, with chorus's longest.
    dist.barrier(group=dist.new_group(timeout=timedelta(days=10000)))
    # The group's timeout is its calls' when CHORUS_TIMEOUT is not set (as with Gloo): ranks
    # that wait for a late one fail within it, with a RuntimeError (as Gloo's timeouts).
    if p > 1 and not os.environ.get("CHORUS_TIMEOUT"):
        late = dist.new_group(timeout=timedelta(seconds=2))
        began = time.monotonic()
        if me == 0:
            time.sleep(6)
        try:
            dist.barrier(group=late)
        except RuntimeError as e:
            assert isinstance(e, chorus.ChorusError), repr(e)
        else:
            # The late rank finds the others' messages there (sent before they gave up).
            assert me == 0, "a barrier waited past its group's 2 s timeout"
        if me != 0:
            took = time.monotonic() - began
            assert took < 5, f"the barrier failed after {took:.1f} s, not its group's 2 s"
    dist.barrier()
    dist.destroy_process_group()
    print(f"ok torch_backend rank {me}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
