//! The learner: fits peak ≈ fixed + slope × micro_batch from measured peaks
//! (one point scales the memory model; two or more: least squares), treats
//! OOMs as upper bounds, and tracks prediction error.
