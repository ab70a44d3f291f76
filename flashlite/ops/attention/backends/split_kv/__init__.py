"""The split-KV backend: few query rows against many keys, the keys split across programs and the
partial results merged exactly: the decode kernel (:mod:`.decode`), the cache step with its append
(:mod:`.cache`), the merge of two partial results (:mod:`.merge`) and the split counts
(:mod:`.splits`)."""
