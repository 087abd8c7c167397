"""Model execution in a layout: the training forward and backward of a model sharded by a
``rlflow.sharding.Layout``, with explicit collectives (see docs/parallel.md).

    collectives.py  copy_to / reduce_from / all_gather / reduce_scatter / all_to_all with their backward
    tp.py           column- and row-parallel linears, vocab-parallel embedding, log-probs and entropy
    ep.py           MoE with experts over ep: all-to-all dispatch, local experts, all-to-all combine
    pp.py           layers per stage, GPipe and 1F1B schedules with activation / gradient send-recv
    dp.py           gradient all-reduce, and reduce-scatter for a sharded optimizer state
    model.py        Qwen3-MoE in a layout: context, shard_params, pp_stage_forward, forward_backward
"""
