{
  "variables": {
    "with_rdmacm%": "<!(test -f /usr/include/rdma/rdma_cma.h -o -f /usr/local/include/rdma/rdma_cma.h && echo 1 || echo 0)"
  },
  "targets": [
    {
      "target_name": "async_rdma_verbs",
      "sources": ["native/verbs.c"],
      "defines": ["NAPI_VERSION=8"],
      "cflags": ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
      "libraries": ["-libverbs"]
    }
  ],
  "conditions": [
    ["with_rdmacm==1", {
      "targets": [
        {
          "target_name": "async_rdma_cm",
          "sources": ["native/cm.c"],
          "defines": ["NAPI_VERSION=8"],
          "cflags": ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
          "libraries": ["-lrdmacm", "-libverbs"]
        }
      ]
    }]
  ]
}
