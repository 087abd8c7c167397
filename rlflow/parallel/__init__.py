"""Model execution in a layout: the model of ``rlflow.models`` run by one rank of a
``rlflow.sharding.Layout``, with explicit collectives (see docs/parallel.md).

    collectives.py  copy_to / reduce_from / all_gather / reduce_scatter / all_to_all with their backward
    context.py      LayoutExec: the model's execution seams on one rank (TP, EP, PP), check_layout, shard_params
    tp.py           column- and row-parallel linears, vocab-parallel embedding, log-probs and entropy
    ep.py           MoE with experts over ep: all-to-all dispatch, local experts, all-to-all combine
    pp.py           layers per stage, GPipe and 1F1B schedules with activation / gradient send-recv
    dp.py           gradient all-reduce, and reduce-scatter for a sharded optimizer state
    train.py        one rank's log-probs, forward and backward over micro-batches through the pipeline
"""
