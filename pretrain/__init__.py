"""orthon.pretrain"""
