"""The wire, imported by controller, host agents and workers alike: the messages (`protocol`, one module per
conversation), the codec that signs and pickles them (`codec`), the sockets' two ends (`controller_end`,
`worker_end`), what keeps them private (`keys`, `hold`, `links`), the rendezvous store (`store`) and the
script debugger's socket (`debug`)."""
