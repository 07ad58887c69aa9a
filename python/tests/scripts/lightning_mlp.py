"""A Lightning script: a LightningModule, its data, `Trainer(accelerator="auto")`, `fit`."""

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class LitClassifier(L.LightningModule):
    def __init__(self, hidden=512, lr=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(784, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
        )

    def forward(self, x):
        return self.net(x.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main():
    data = TensorDataset(torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,)))
    trainer = L.Trainer(accelerator="auto", devices=1, max_epochs=1, logger=False)
    trainer.fit(LitClassifier(), DataLoader(data, batch_size=64, shuffle=True))


if __name__ == "__main__":
    main()
