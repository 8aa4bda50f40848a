//! A decoder's weights read from any file format: the loaders (GGUF,
//! safetensors) say how to read one named matrix or vector, and
//! [`read_weights`] asks for every tensor the family has by its
//! [`TensorId`], spelled in the loader's [`Format`] by
//! `tandem_modelfile::plan::names` (the one place tensor names live).

use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::plan::{Format, Part, TensorId};

use crate::error::ModelError;
use crate::model::{FfnWeights, LayerWeights, ModelWeights};
use crate::moe::{Expert, MoeWeights};
use crate::weight::Weight;

/// Named tensors of one file format.
pub(crate) trait TensorSource {
    /// The format whose names this source holds.
    fn format(&self) -> Format;
    /// A 2-D tensor as a weight matrix (rows x columns).
    fn matrix(&self, name: &str) -> Result<Weight, ModelError>;
    /// A 1-D tensor as f32.
    fn vector(&self, name: &str) -> Result<Vec<f32>, ModelError>;
    fn contains(&self, name: &str) -> bool;
}

/// Reads a tensor of a model of `c`'s family from `src`.
struct Reader<'a> {
    src: &'a dyn TensorSource,
    c: &'a ModelConfig,
}

impl Reader<'_> {
    fn name(&self, id: TensorId) -> Result<String, ModelError> {
        id.name(self.src.format(), self.c.family)
            .ok_or_else(|| ModelError::MissingTensor(id.gguf()))
    }

    fn matrix(&self, id: TensorId) -> Result<Weight, ModelError> {
        self.src.matrix(&self.name(id)?)
    }

    fn vector(&self, id: TensorId) -> Result<Vec<f32>, ModelError> {
        self.src.vector(&self.name(id)?)
    }

    fn present(&self, id: TensorId) -> bool {
        self.name(id).is_ok_and(|n| self.src.contains(&n))
    }

    /// Layer `i`'s `parts`' weights (or biases) as vectors, when `wanted`.
    fn vectors<const N: usize>(
        &self,
        wanted: bool,
        parts: [TensorId; N],
    ) -> Result<Option<[Vec<f32>; N]>, ModelError> {
        if !wanted {
            return Ok(None);
        }
        let mut out: [Vec<f32>; N] = std::array::from_fn(|_| Vec::new());
        for (o, id) in out.iter_mut().zip(parts) {
            *o = self.vector(id)?;
        }
        Ok(Some(out))
    }

    fn ffn(&self, i: usize) -> Result<FfnWeights, ModelError> {
        let w = |p: Part| self.matrix(TensorId::weight(i, p));
        let Some(moe) = &self.c.moe else {
            return Ok(FfnWeights::Dense {
                gate: w(Part::FfnGate)?,
                up: w(Part::FfnUp)?,
                down: w(Part::FfnDown)?,
            });
        };
        let bias = TensorId::bias(i, Part::RouterBias);
        Ok(FfnWeights::Moe(MoeWeights {
            router: w(Part::Router)?,
            correction_bias: match self.present(bias) {
                true => Some(self.vector(bias)?),
                false => None,
            },
            experts: (0..moe.n_experts)
                .map(|j| {
                    Ok(Expert {
                        gate: w(Part::ExpertGate(j))?,
                        up: w(Part::ExpertUp(j))?,
                        down: w(Part::ExpertDown(j))?,
                    })
                })
                .collect::<Result<_, ModelError>>()?,
        }))
    }

    fn layer(&self, i: usize) -> Result<LayerWeights, ModelError> {
        let fam = self.c.family;
        let w = |p: Part| TensorId::weight(i, p);
        let b = |p: Part| TensorId::bias(i, p);
        Ok(LayerWeights {
            attn_norm: self.vector(w(Part::AttnNorm))?,
            wq: self.matrix(w(Part::AttnQ))?,
            wk: self.matrix(w(Part::AttnK))?,
            wv: self.matrix(w(Part::AttnV))?,
            wo: self.matrix(w(Part::AttnOutput))?,
            ffn_norm: self.vector(w(Part::FfnNorm))?,
            ffn: self.ffn(i)?,
            qkv_bias: self.vectors(
                fam.qkv_bias,
                [b(Part::AttnQ), b(Part::AttnK), b(Part::AttnV)],
            )?,
            qk_norm: self.vectors(fam.qk_norm, [w(Part::AttnQNorm), w(Part::AttnKNorm)])?,
            post_norms: self.vectors(
                fam.post_norms,
                [w(Part::PostAttnNorm), w(Part::PostFfnNorm)],
            )?,
        })
    }
}

/// Every weight of a model of `c` from `src`; with `tie` the model has no
/// output head of its own, even where the files hold one.
pub(crate) fn read_weights(
    src: &dyn TensorSource,
    c: &ModelConfig,
    tie: bool,
) -> Result<ModelWeights, ModelError> {
    let r = Reader { src, c };
    let layers = (0..c.n_layers)
        .map(|i| r.layer(i))
        .collect::<Result<Vec<_>, _>>()?;
    let output = match !tie && r.present(TensorId::Output) {
        true => Some(r.matrix(TensorId::Output)?),
        false => None,
    };
    Ok(ModelWeights {
        token_embd: r.matrix(TensorId::Embeddings)?,
        layers,
        output_norm: r.vector(TensorId::OutputNorm)?,
        output,
    })
}
