//! The fake NVML library's integration tests, in one test binary: its C ABI driven as a C
//! client would (`c_api`), and the cross-check of its independent MIG rules and tables
//! against migdra-api's catalog and slice model (`independent_rules`).

mod c_api;
mod independent_rules;
