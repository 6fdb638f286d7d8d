//! Train a model with a loop of your own around the trainer's step: the
//! config, the corpus and the batches from tvq, and a print (or anything
//! else: your own metrics, early stopping) after each step; then export.
//!
//!     cargo run --release -p tvq-train --example custom_loop -- \
//!         configs/quickstart.toml 20 quickstart-20.safetensors

use anyhow::Result;
use burn::DispatchDevice;
use tvq_data::{Corpus, Split, TrainBatches, TrainCursor};
use tvq_model::TransformerVqConfig;
use tvq_train::inference::export::{ExportInfo, export};
use tvq_train::placement::device::DeviceSpec;
use tvq_train::placement::{OnTrainBackend, TrainBackend, TrainOn};
use tvq_train::{RunConfig, Trainer};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let config = args
        .get(1)
        .map_or("configs/quickstart.toml", String::as_str);
    let steps: u64 = args.get(2).map_or(Ok(20), |s| s.parse())?;

    // The run's config (with overrides, as `--set` takes them), its corpus,
    // and the model it describes for the corpus's vocabulary.
    let cfg = RunConfig::load(config.as_ref(), &["train.workers=1".into()])?;
    let corpus = Corpus::open(&cfg.data)?;
    let model = cfg.model_config(corpus.vocab.size());
    let (device, name) = DeviceSpec::Cpu.init()?;
    // The backend `tvq train` would pick for this config and device: on
    // the CPU, the fused attention and quantizer kernels unless the
    // config's `train.kernels` says "composed".
    let on = TrainOn::choose(&cfg.train, std::slice::from_ref(&device));
    println!("{} parameters on {name}, {on}", model.num_params());
    on.run(Loop {
        cfg: &cfg,
        corpus: &corpus,
        model: &model,
        device,
        steps,
        out: args.get(3).map(String::as_str),
    })
}

/// The loop, generic over the trainer's backend, which [`TrainOn::run`]
/// picks once.
struct Loop<'a> {
    cfg: &'a RunConfig,
    corpus: &'a Corpus,
    model: &'a TransformerVqConfig,
    device: DispatchDevice,
    steps: u64,
    out: Option<&'a str>,
}

impl OnTrainBackend for Loop<'_> {
    type Output = Result<()>;

    fn run<Bk: TrainBackend>(self) -> Result<()> {
        let Self {
            cfg,
            corpus,
            model,
            device,
            steps,
            out,
        } = self;
        // The trainer holds the model, the optimizers and the carried
        // state; the batches come in the run's seeded order, resumable
        // from a cursor.
        let mut trainer = Trainer::<Bk>::start(model, &cfg.train, &[device])?;
        let layout = cfg.data.train_layout(cfg.train.seed);
        let mut batches =
            TrainBatches::new(corpus.split(Split::Train), layout, TrainCursor::default())?;
        for _ in 0..steps {
            let batch = batches.next().expect("training batches never end");
            let out = trainer.step(&batch, batches.cursor())?;
            let bits = out.ce / std::f64::consts::LN_2;
            println!(
                "step {:>4}  lr {:.2e}  loss {:.4}  {bits:.3} bits/token  grad norm {:.3}",
                out.step, out.lr, out.loss, out.grad_norm
            );
        }

        if let Some(out) = out {
            let info = ExportInfo {
                format: "tvq".into(),
                model: model.clone(),
                vocab: corpus.vocab.id(),
                tokenizer: cfg.data.tokenizer.clone(),
                step: trainer.state().step,
            };
            export(&trainer.inference_model(), &info, out.as_ref())?;
            println!("exported to {out}");
        }
        Ok(())
    }
}
