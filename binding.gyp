{
  "targets": [
    {
      "target_name": "async_rdma_verbs",
      "sources": ["native/verbs.c"],
      "defines": ["NAPI_VERSION=8"],
      "cflags": ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
      "libraries": ["-libverbs"]
    }
  ]
}
