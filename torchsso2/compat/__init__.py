"""Faces that take other libraries' arguments and convert them to torchsso2's conventions.

* :mod:`torchsso2.compat.pytorch_sso` — PyTorch-SSO's ``SecondOrderOptimizer`` / ``VIOptimizer``
  signatures and example config JSON.

(kfac_pytorch's API is :mod:`torchsso2.kfac` itself.)
"""
