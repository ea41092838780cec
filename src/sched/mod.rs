//! Bandwidth scheduling across concurrent loads (sans-IO): compute model, policies, planner.
#![forbid(unsafe_code)]
