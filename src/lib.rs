//! Library code of the `locus` binary: the orchestration its commands run (`ops`), kept
//! apart from argument parsing and printing so it can be called and tested on its own.

pub mod ops;
