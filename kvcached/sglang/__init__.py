"""kvcached under SGLang: elastic pages behind SGLang's KV pools, HiCache copies pinned."""
