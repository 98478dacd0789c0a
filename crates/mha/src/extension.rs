//! What the crate's backend extensions (the flash op, the projection op) pass across Burn's
//! dispatch besides plain tensors: the extension macro maps tensors and enums of tensors, not
//! `Option`s.

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, ExtensionType};

/// An optional float tensor across the dispatch boundary.
#[derive(ExtensionType)]
pub enum MaybeFloat<B: Backend> {
    /// A tensor.
    Some(FloatTensor<B>),
    /// No tensor.
    None,
}

/// An optional bool tensor across the dispatch boundary.
#[derive(ExtensionType)]
pub enum MaybeBool<B: Backend> {
    /// A tensor.
    Some(BoolTensor<B>),
    /// No tensor.
    None,
}

impl<B: Backend> MaybeFloat<B> {
    pub(crate) fn from_option(tensor: Option<FloatTensor<B>>) -> Self {
        tensor.map_or(Self::None, Self::Some)
    }

    pub(crate) fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Self::Some(tensor) => Some(tensor),
            Self::None => None,
        }
    }
}

impl<B: Backend> MaybeBool<B> {
    pub(crate) fn from_option(tensor: Option<BoolTensor<B>>) -> Self {
        tensor.map_or(Self::None, Self::Some)
    }

    pub(crate) fn into_option(self) -> Option<BoolTensor<B>> {
        match self {
            Self::Some(tensor) => Some(tensor),
            Self::None => None,
        }
    }
}
