//! Log parsers: a training log → a run result (SPEC §5). Pure: text in,
//! result out; any input gives a result or a clear error, never a panic.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum LogParseError {
    #[error("no training result found in the log: {0}")]
    NothingFound(String),
}
