"""Generated code of what cluster nodes say to each other (scripts/gen_proto.sh)."""
